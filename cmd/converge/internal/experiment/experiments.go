package experiment

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/kafkatopic"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/projections/taskview"
)

var experiments = []Experiment{
	{"confirm-lost", "Publisher confirm lost: duplicate publish, one effect", "15 experiment 1, 13.2", confirmLost},
	{"effect-timeout", "Artifact write committed but timed out: resolved by observation", "15 experiment 2, 7", effectTimeout},
	{"corrupt-artifact", "Corrupted artifact: compensation hides it, task fails", "15 experiment 3, 8", corruptArtifact},
	{"same-key-different-request", "Same idempotency key, different request: stable error, no second task", "15 experiment 4, 3", sameKey},
	{"response-lost", "API response lost: the client retries with the same key", "13.1, 14", responseLost},
	{"poison-replay", "Poison message: dead letter, fix, replay, completes", "13.5, 14", poisonReplay},
	{"stale-cache", "Stale cache: the version wins, the reconciler repairs a view older or newer (forged) than the database", "9, 13.6, 14", staleCache},
	{"crash-after-artifact-write", "Crash between artifact write and completion: restart completes with one artifact", "13.3, 12", crashAfterWrite},
	{"database-outage", "PostgreSQL unreachable for 30 s under load: 503s, nothing stops, everything completes after", "14, issue 13", databaseOutage},
	{"kafka-outage", "Kafka unreachable for 30 s under load: the API accepts, the outbox holds, nothing stops, everything completes after", "14, issue 13", kafkaOutage},
}

func arm(spec string) (*fault.Set, error) { return fault.Parse(spec) }

func confirmLost(ctx context.Context, x *X) error {
	faults, err := arm(fault.RelayPublishConfirmLost + "=error@1")
	if err != nil {
		return err
	}
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	id, err := x.create(ctx, "exp-confirm-lost-1", []byte(`{"experiment":"confirm-lost","n":[3,2,1]}`))
	if err != nil {
		return err
	}
	x.step("created task %s; the relay produces its TaskCreated, Kafka acknowledges, the relay sees an error (%s)", id, fault.RelayPublishConfirmLost)
	perr := x.wait(ctx)
	if !x.check("relay failed on the lost confirm", errors.Is(perr, fault.ErrInjected), "pipeline stopped with: %v", perr) {
		return nil
	}
	x.step("the relay stopped without advancing the slot past the record (outbox row unpublished: %d)",
		x.scalar(ctx, `SELECT count(*) FROM outbox_event WHERE aggregate_id = $1 AND outbox_published_at(outbox_event) IS NULL`, id))
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	x.step("restarted the pipeline: the relay resumes from the slot and publishes the same outbox row again (same event id)")
	if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
		return err
	}
	var eventID string
	_ = x.pool.QueryRow(ctx, `SELECT outbox_id FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskCreated'`, id).Scan(&eventID)
	// The task may have completed from the first copy before the restart:
	// the second copy is on Kafka once the inbox saw it, not before.
	var deliveries int64
	_ = until(ctx, 20*time.Second, "both copies delivered", func() bool {
		deliveries = x.scalar(ctx, `SELECT deliveries FROM inbox_message WHERE message_id = $1`, eventID)
		return deliveries >= 2
	})
	published, err := countRecords(ctx, x.env.Brokers, taskevent.DefaultTopic, eventID)
	if err != nil {
		return err
	}
	x.check("the TaskCreated record is on Kafka at least twice", published >= 2, "%d records with event-id %s", published, eventID)
	x.check("the inbox absorbed the duplicate", deliveries >= 2, "inbox deliveries of %s: %d", eventID, deliveries)
	_, v, _ := x.status(ctx, id)
	x.check("the task version advanced once", v == 2, "task version %d, want 2", v)
	effects := x.scalar(ctx, `SELECT count(*) FROM effect_ledger WHERE task_id = $1 AND effect_kind = 'artifact.put'`, id)
	x.check("one artifact effect (one business token)", effects == 1, "%d artifact.put effects", effects)
	x.rep.Counts["published_copies"] = published
	x.rep.Counts["worker_duplicates_metric"] = x.metric("converge_worker_messages_total", map[string]string{"outcome": worker.OutcomeDuplicate})
	return nil
}

// countRecords counts the records of topic whose event-id header is id,
// reading the topic to its end offsets at the call (within 30 s).
func countRecords(ctx context.Context, brokers []string, topic, id string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n := 0
	err := kafkatopic.ReadToEnd(ctx, brokers, topic, func(r *kgo.Record) {
		for _, h := range r.Headers {
			if h.Key == taskevent.HeaderEventID && string(h.Value) == id {
				n++
			}
		}
	})
	return n, err
}

func effectTimeout(ctx context.Context, x *X) error {
	faults, err := arm(fault.ArtifactPutTimeoutAfterCommit + "=error@1")
	if err != nil {
		return err
	}
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	id, err := x.create(ctx, "exp-effect-timeout-1", []byte(`{"experiment":"effect-timeout"}`))
	if err != nil {
		return err
	}
	x.step("created task %s; the store writes the artifact durably, the worker sees a timeout", id)
	if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
		return err
	}
	x.check("the timeout fault fired", faults.Fired(fault.ArtifactPutTimeoutAfterCommit) == 1, "fired %d times", faults.Fired(fault.ArtifactPutTimeoutAfterCommit))
	unknown := x.metric("converge_worker_effect_transitions_total", map[string]string{"kind": "artifact.put", "state": "unknown"})
	x.check("the effect went through unknown", unknown == 1, "transitions to unknown: %v", unknown)
	x.step("the worker recorded the effect unknown, observed the same token, found the object and verified it")
	objs, _ := filepath.Glob(filepath.Join(x.env.ArtifactDir, "objects", id+".*.obj"))
	x.check("one object in the store, no new token", len(objs) == 1, "%d objects for the task", len(objs))
	return nil
}

func corruptArtifact(ctx context.Context, x *X) error {
	faults, err := arm(fault.ArtifactCorruptAfterWrite + "=corrupt")
	if err != nil {
		return err
	}
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	id, err := x.create(ctx, "exp-corrupt-1", []byte(`{"experiment":"corrupt-artifact"}`))
	if err != nil {
		return err
	}
	x.step("created task %s; the store appends bytes after the write (hash mismatch on read-back)", id)
	if err := x.waitStatus(ctx, id, taskevent.StatusFailed); err != nil {
		return err
	}
	_, _, code := x.status(ctx, id)
	x.check("task failed with a stable code", code == worker.CodeArtifactVerificationFailed, "terminal_error_code %q", code)
	token := artifact.Token(id, 1)
	if err := until(ctx, 20*time.Second, "effect compensated", func() bool {
		return x.scalar(ctx, `SELECT count(*) FROM effect_ledger WHERE effect_id = $1 AND state = 'compensated'`, token) == 1
	}); err != nil {
		return err
	}
	hide := x.scalar(ctx, `SELECT count(*) FROM effect_ledger WHERE effect_id = $1 AND effect_kind = 'artifact.hide' AND state = 'verified'`, "compensation-for-"+token)
	x.check("compensation is its own verified ledger entry", hide == 1, "artifact.hide compensation-for-%s verified: %d", token, hide)
	x.step("the worker failed the task, wrote compensation-for-%s, hid the object, verified it is gone", token)
	store, err := artifact.Open(x.env.ArtifactDir, nil)
	if err != nil {
		return err
	}
	_, herr := store.Head(token)
	x.check("the artifact is not readable in the store", errors.Is(herr, artifact.ErrNotFound), "Head: %v", herr)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, x.api+"/v1/tasks/"+id+"/artifact", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+x.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	x.check("the artifact is not readable through the API", resp.StatusCode == http.StatusConflict, "GET artifact: %d", resp.StatusCode)
	x.step("replaying the same message would be a duplicate: the inbox holds the failed summary")
	return nil
}

func sameKey(ctx context.Context, x *X) error {
	if err := x.start(ctx, nil, nil); err != nil {
		return err
	}
	key := "exp-same-key-0001"
	a, b := []byte(`{"input":"A"}`), []byte(`{"input":"B"}`)
	id, err := x.create(ctx, key, a)
	if err != nil {
		return err
	}
	x.step("POST document A with key %s: task %s", key, id)
	st, body, replayed, err := x.post(ctx, key, a)
	if err != nil {
		return err
	}
	x.check("same key, same request: the first response", st == http.StatusAccepted && replayed && body["task_id"] == id,
		"status %d, replayed %v, task %v", st, replayed, body["task_id"])
	st, body, _, err = x.post(ctx, key, b)
	if err != nil {
		return err
	}
	x.check("same key, different request: stable error", st == http.StatusUnprocessableEntity && body["code"] == "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_REQUEST",
		"status %d, code %v", st, body["code"])
	x.step("POST A again: replayed; POST B with the same key: %d %v", st, body["code"])
	return x.waitStatus(ctx, id, taskevent.StatusCompleted)
}

func responseLost(ctx context.Context, x *X) error {
	faults, err := arm(fault.APIAfterCommitResponseLost + "=error@1")
	if err != nil {
		return err
	}
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	key, doc := "exp-response-lost-1", []byte(`{"experiment":"response-lost"}`)
	_, _, _, perr := x.post(ctx, key, doc)
	x.check("the first response was lost", perr != nil, "first POST: %v", perr)
	x.step("POST with key %s: the transaction committed, the connection was closed before the response", key)
	st, body, replayed, err := x.post(ctx, key, doc)
	if err != nil {
		return err
	}
	id, _ := body["task_id"].(string)
	x.check("the retry with the same key gets the first response", st == http.StatusAccepted && replayed && id != "", "status %d, replayed %v", st, replayed)
	x.keys, x.tasks = append(x.keys, key), append(x.tasks, id)
	x.step("retried with the same key: %d, Idempotent-Replayed %v, task %s", st, replayed, id)
	return x.waitStatus(ctx, id, taskevent.StatusCompleted)
}

func poisonReplay(ctx context.Context, x *X) error {
	doc := []byte(`{"experiment":"poison","payload":[1,2,3]}`)
	canonical, err := canon.Transform(doc)
	if err != nil {
		return err
	}
	sha := canon.SHA256Hex(canonical)
	faults, err := arm(fault.WorkerProcessError + "=error#" + sha)
	if err != nil {
		return err
	}
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	x.step("armed %s=error#%s (the document's input SHA-256): its processing fails deterministically", fault.WorkerProcessError, sha)
	id, err := x.create(ctx, "exp-poison-1", doc)
	if err != nil {
		return err
	}
	healthy, err := x.create(ctx, "exp-poison-healthy-1", []byte(`{"experiment":"poison","healthy":true}`))
	if err != nil {
		return err
	}
	if err := x.waitStatus(ctx, id, taskevent.StatusFailed); err != nil {
		return err
	}
	if err := x.waitStatus(ctx, healthy, taskevent.StatusCompleted); err != nil {
		return err
	}
	_, _, code := x.status(ctx, id)
	x.check("the poison task failed with a stable code", code == worker.CodeInjectedProcessingError, "terminal_error_code %q", code)
	x.step("task %s failed (%s) at the first attempt and was dead-lettered; task %s completed meanwhile", id, code, healthy)
	var dlID int64
	if err := until(ctx, 30*time.Second, "dead letter recorded", func() bool {
		return x.pool.QueryRow(ctx, `SELECT dead_letter_id FROM dead_letter WHERE task_id = $1`, id).Scan(&dlID) == nil
	}); err != nil {
		return err
	}
	x.step("the reconciler recorded dead letter %d from the dead-letter topic", dlID)
	faults.Disarm(fault.WorkerProcessError)
	x.step("the fix: the fault is disarmed")
	producer, err := kgo.NewClient(kgo.SeedBrokers(x.env.Brokers...))
	if err != nil {
		return err
	}
	defer producer.Close()
	svc, err := deadletter.New(deadletter.Config{Pool: x.pool, Producer: producer})
	if err != nil {
		return err
	}
	res, err := svc.Replay(ctx, dlID, deadletter.Request{Reason: "poison fault disarmed (experiment)", By: "converge experiment"})
	if err != nil {
		return err
	}
	x.check("replay re-published the original and re-opened the task", res.Outcome == deadletter.OutcomeReplayed && res.TaskReopened, "%+v", res)
	x.step("replay: %s", res.Message)
	if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
		return err
	}
	x.step("task %s completed after the replay", id)
	again, err := svc.Replay(ctx, dlID, deadletter.Request{Reason: "second replay (experiment)", By: "converge experiment"})
	if err != nil {
		return err
	}
	x.check("a replay of a completed task is a no-op", again.Outcome == deadletter.OutcomeNoop && again.State == deadletter.StateResolved, "%+v", again)
	x.step("second replay: %s", again.Message)
	x.rep.Counts["dead_letters_published_metric"] = x.metric("converge_deadletter_published_total", nil)
	return nil
}

func staleCache(ctx context.Context, x *X) error {
	faults := &fault.Set{}
	if err := x.start(ctx, faults, nil); err != nil {
		return err
	}
	id, err := x.create(ctx, "exp-stale-cache-1", []byte(`{"experiment":"stale-cache"}`))
	if err != nil {
		return err
	}
	if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
		return err
	}
	opt, err := redis.ParseURL(x.env.RedisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	cache, err := taskview.NewCache(rdb, taskview.CacheOptions{})
	if err != nil {
		return err
	}
	if err := until(ctx, 20*time.Second, "view at v2", func() bool {
		t, ok, _ := cache.Get(ctx, id)
		return ok && t.Version == 2
	}); err != nil {
		return err
	}
	x.step("task %s completed (v2); the projector stored the view at v2", id)
	var created taskevent.Event
	var payload []byte
	_ = x.pool.QueryRow(ctx, `SELECT payload::text FROM outbox_event WHERE aggregate_id = $1 AND event_type = 'TaskCreated'`, id).Scan(&payload)
	ev, err := taskevent.Decode(payload)
	if err != nil {
		return err
	}
	created = *ev
	stored, _ := cache.Put(ctx, created.Task)
	x.check("an older snapshot never overwrites a newer view", !stored, "Put(v0) over v2 stored=%v", stored)
	if err := cache.Invalidate(ctx, id); err != nil {
		return err
	}
	stored, _ = cache.Put(ctx, created.Task)
	x.step("simulated a stale view: DEL then a late v0 write (the window the view's doc describes): stored=%v", stored)
	t, err := x.client().Get(ctx, id)
	if err != nil {
		return err
	}
	x.step("GET /v1/tasks/%s right after: status %s v%d (a cache hit may be stale; the version tells)", id, t.Status, t.Version)
	if err := until(ctx, 20*time.Second, "view repaired", func() bool {
		t, ok, _ := cache.Get(ctx, id)
		return ok && t.Version == 2
	}); err != nil {
		return err
	}
	// The reconciler counts its repair after the write the loop above saw.
	var repaired float64
	_ = until(ctx, 5*time.Second, "repair counted", func() bool {
		repaired = x.metric("converge_reconciler_actions_total", map[string]string{"kind": "cache_repaired"})
		return repaired >= 1
	})
	x.check("the reconciler repaired the view to the database version", repaired >= 1, "cache_repaired actions: %v", repaired)
	x.step("the reconciler's cache scan found v0 < v2 in PostgreSQL and wrote v2")
	if err := faults.ArmKey(fault.CacheWriteError, fault.ActionError, 0, id); err != nil {
		return err
	}
	if err := cache.Invalidate(ctx, id); err != nil {
		return err
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, x.api+"/v1/tasks/"+id, nil)
	req.Header.Set("Authorization", "Bearer "+x.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	cs := resp.Header.Get("Cache-Status")
	x.check("a failing cache write does not fail the read", resp.StatusCode == http.StatusOK && resp.Header.Get("ETag") == `"2"`,
		"GET: %d ETag %s Cache-Status %q", resp.StatusCode, resp.Header.Get("ETag"), cs)
	x.step("armed %s for the task, deleted the view: GET answers v2 from PostgreSQL (Cache-Status %q)", fault.CacheWriteError, cs)
	faults.Disarm(fault.CacheWriteError)
	return forgedEvent(ctx, x, cache, id)
}

// forgedEvent is the view "from the future" of issue 13: a TaskFailed at
// version 999 that no transaction wrote, produced straight to the
// (unauthenticated, dev) broker. The projector stores it — a view never
// goes older, so it cannot tell — and the reconciler's cache scan removes
// a view ahead of PostgreSQL (compare-and-delete on that version); the
// next read serves the database's version again.
func forgedEvent(ctx context.Context, x *X, cache *taskview.Cache, id string) error {
	t, found, err := task.Get(ctx, x.pool, id)
	if err != nil || !found {
		return fmt.Errorf("read task %s: found=%v %w", id, found, err)
	}
	code := "FORGED"
	forged := t
	forged.Version, forged.Status, forged.TerminalErrorCode = 999, taskevent.StatusFailed, &code
	ev, err := outbox.NewEvent(taskevent.TypeTaskFailed, forged, time.Now())
	if err != nil {
		return err
	}
	row, err := outbox.RowOf(&ev)
	if err != nil {
		return err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(x.env.Brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	rec := cdc.RecordOf(outbox.Stored{ID: row.ID, TaskID: row.TaskID, Version: row.Version, Type: row.Type, TenantID: row.TenantID,
		Payload: row.Payload, PayloadSHA256: row.PayloadSHA256}, taskevent.DefaultTopic)
	if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
		return fmt.Errorf("produce the forged event: %w", err)
	}
	x.step("produced a forged TaskFailed v999 for task %s straight to the broker (no transaction wrote it)", id)
	projected := until(ctx, 20*time.Second, "forged view projected", func() bool {
		v, ok, _ := cache.Get(ctx, id)
		return ok && v.Version == 999
	}) == nil
	x.step("the projector stored the forged view: %v (it cannot tell a forged event from a new one)", projected)
	if err := until(ctx, 30*time.Second, "forged view removed", func() bool {
		v, ok, _ := cache.Get(ctx, id)
		return !ok || v.Version == t.Version
	}); err != nil {
		return err
	}
	got, err := x.client().Get(ctx, id)
	if err != nil {
		return err
	}
	x.check("a view ahead of PostgreSQL is removed; reads serve the database's version", got.Version == t.Version && got.Status == t.Status,
		"GET after the repair: %s v%d (PostgreSQL: %s v%d)", got.Status, got.Version, t.Status, t.Version)
	return nil
}

func crashAfterWrite(ctx context.Context, x *X) error {
	faults, err := arm(fault.WorkerAfterArtifactWrite + "=error")
	if err != nil {
		return err
	}
	tune := func(c *pipeline.Config) { c.Worker.MaxAttempts = 1000 }
	if err := x.start(ctx, faults, tune); err != nil {
		return err
	}
	id, err := x.create(ctx, "exp-crash-after-write-1", []byte(`{"experiment":"crash-after-artifact-write"}`))
	if err != nil {
		return err
	}
	if err := until(ctx, 30*time.Second, "fault fired", func() bool { return faults.Fired(fault.WorkerAfterArtifactWrite) >= 2 }); err != nil {
		return err
	}
	st, _, _ := x.status(ctx, id)
	x.step("task %s: the artifact is written, the completion transaction never runs (fault fired %d times); task %s", id, faults.Fired(fault.WorkerAfterArtifactWrite), st)
	if err := x.stop(); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	x.step("stopped the whole pipeline with the task running and its offset uncommitted (an in-process stand-in for the crash)")
	faults.Disarm(fault.WorkerAfterArtifactWrite)
	if err := x.start(ctx, faults, tune); err != nil {
		return err
	}
	x.step("restarted: the record is redelivered, the inbox row is resumed, the ledger finds the object by token")
	if err := x.waitStatus(ctx, id, taskevent.StatusCompleted); err != nil {
		return err
	}
	objs, _ := filepath.Glob(filepath.Join(x.env.ArtifactDir, "objects", id+".*.obj"))
	x.check("one artifact object", len(objs) == 1, "%d objects", len(objs))
	var attempt int
	_ = x.pool.QueryRow(ctx, `SELECT attempt FROM task WHERE task_id = $1`, id).Scan(&attempt)
	x.check("no second attempt", attempt == 1, "attempt %d", attempt)
	return nil
}
