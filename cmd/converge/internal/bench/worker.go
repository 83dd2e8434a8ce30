package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/taskevent"
)

// WorkerResult compares the worker with pgbench running its statements.
type WorkerResult struct {
	Tasks int `json:"tasks"`
	// WorkerRate is tasks/s of each run, from the first completed task to
	// the last (the consumer group join is left out).
	WorkerRate   []float64 `json:"worker_tasks_per_sec"`
	WorkerMedian float64   `json:"worker_median"`
	// JoinSeconds is the time from the worker's start to its first
	// completed task, per run.
	JoinSeconds []float64 `json:"join_seconds"`
	// RecordMS is the mean time one record took from its first attempt to
	// its durable outcome (converge_worker_processing_seconds), per run.
	// Concurrency is rate × RecordMS: how many records were in process at
	// once on average (Little's law), against the 4 the worker allows.
	RecordMS    []float64 `json:"record_ms"`
	Concurrency []float64 `json:"effective_concurrency"`
	// PartitionsPerPoll is how many partitions one PollRecords(500) of the
	// pre-filled topic returns on average (a plain consumer with the
	// worker's client defaults): the worker processes the partitions of
	// one poll concurrently, so this bounds its concurrency.
	PartitionsPerPoll float64 `json:"partitions_per_poll"`
	// PgbenchClients is the worker's partition concurrency.
	PgbenchClients int       `json:"pgbench_clients"`
	PgbenchTPS     []float64 `json:"pgbench_tasks_per_sec"`
	PgbenchMedian  float64   `json:"pgbench_median"`
	Ratio          float64   `json:"ratio"`
	// ArtifactRate is Put + Observe (read back) of the artifact store
	// alone with PgbenchClients goroutines: the worker's file work that
	// pgbench does not do.
	ArtifactRate []float64 `json:"artifact_put_observe_per_sec"`
	ArtifactMed  float64   `json:"artifact_median"`
	// FdatasyncPerSec is one goroutine writing 4 KiB and calling
	// fdatasync in a loop in the bench directory (the filesystem of the
	// cluster and the artifacts): the latency floor of every durable step.
	FdatasyncPerSec float64 `json:"fdatasync_per_sec"`
	WorkerCPU       CPU     `json:"worker_cpu"`
	PgbenchCPU      CPU     `json:"pgbench_cpu"`
	ArtifactCPU     CPU     `json:"artifact_cpu"`
}

// runWorker is stage 3.
func runWorker(ctx context.Context, e *env, res *Results) error {
	workerConcurrency := e.cfg.WorkerConcurrency
	dbURL, pool, err := e.newDB(ctx, "bench_worker")
	if err != nil {
		return err
	}
	defer pool.Close()
	fx := newFixtures(e.cfg.DocSize)
	n := e.cfg.WorkerTasks
	perClient := max(n/workerConcurrency, 1)
	wr := &WorkerResult{Tasks: n, PgbenchClients: workerConcurrency}
	kcl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.RequiredAcks(kgo.AllISRAcks()), kgo.ProducerLinger(5*time.Millisecond))
	if err != nil {
		return err
	}
	defer kcl.Close()
	if _, err := pool.Exec(ctx, "CREATE SEQUENCE bench_pgw_seq"); err != nil {
		return err
	}
	for i := range e.cfg.Runs {
		topic := fmt.Sprintf("bench.worker.%d", i)
		if err := fillWorker(ctx, pool, kcl, fx, topic, fmt.Sprintf("w%d", i), n, int32(e.cfg.Partitions)); err != nil {
			return err
		}
		if err := fillPgbenchTasks(ctx, pool, fx, i, perClient*workerConcurrency); err != nil {
			return err
		}
		if i == 0 {
			if wr.PartitionsPerPoll, err = partitionsPerPoll(ctx, e.brokers, topic, n); err != nil {
				return err
			}
			e.progress("worker  a poll of 500 records of the pre-filled topic spans %.2f partitions on average", wr.PartitionsPerPoll)
		}
		stop := func() {}
		if i == 0 {
			stop = e.profile("worker")
		}
		m := e.cpuStart()
		rate, join, recSecs, err := workerOnce(ctx, e, dbURL, topic, fmt.Sprintf("bench-worker-%d", i), i, n)
		wr.WorkerCPU = m.stop(0)
		stop()
		if err != nil {
			return err
		}
		wr.WorkerRate = append(wr.WorkerRate, round2(rate))
		wr.JoinSeconds = append(wr.JoinSeconds, round2(join))
		wr.RecordMS = append(wr.RecordMS, round2(recSecs*1000))
		wr.Concurrency = append(wr.Concurrency, round2(rate*recSecs))

		m = e.cpuStart()
		pr, err := e.pgbench(ctx, "bench_worker", workerScript(fx, i), workerConcurrency, 0, perClient)
		wr.PgbenchCPU = m.stop(pr.CPU)
		if err != nil {
			return err
		}
		wr.PgbenchTPS = append(wr.PgbenchTPS, round2(pr.TPS))

		m = e.cpuStart()
		ar, err := artifactRate(filepath.Join(e.dir, fmt.Sprintf("artifacts-probe-%d", i)), fx, workerConcurrency, min(n, 2000))
		wr.ArtifactCPU = m.stop(0)
		if err != nil {
			return err
		}
		wr.ArtifactRate = append(wr.ArtifactRate, round2(ar))
		e.progress("worker  run %d: worker %.0f tasks/s (join %.1fs, %.2f ms per record, %.2f records in process on average), pgbench %.0f tasks/s, artifact store alone %.0f put+observe/s; cpu worker %+v pgbench %+v",
			i+1, rate, join, recSecs*1000, rate*recSecs, pr.TPS, ar, wr.WorkerCPU, wr.PgbenchCPU)
	}
	if wr.FdatasyncPerSec, err = fdatasyncRate(filepath.Join(e.dir, "fsync-probe")); err != nil {
		return err
	}
	e.progress("worker  alone: fdatasync of a 4 KiB write %.0f/s (%.2f ms each)", wr.FdatasyncPerSec, 1000/wr.FdatasyncPerSec)
	wr.WorkerMedian, wr.PgbenchMedian, wr.ArtifactMed = round2(median(wr.WorkerRate)), round2(median(wr.PgbenchTPS)), round2(median(wr.ArtifactRate))
	wr.Ratio = round2(ratio(wr.WorkerMedian, wr.PgbenchMedian))
	res.Worker = wr
	return nil
}

// fillWorker writes n queued tasks with their input and produces their
// TaskCreated events to topic (the given partitions, keyed by task id), as the API
// and the relay would have.
func fillWorker(ctx context.Context, pool *pgxpool.Pool, kcl *kgo.Client, fx *fixtures, topic, prefix string, n int, partitions int32) error {
	adm := kadm.NewClient(kcl)
	if _, err := adm.CreateTopic(ctx, partitions, 1, nil, topic); err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-task-%08d", prefix, i)
	}
	if err := copyTasks(ctx, pool, fx, ids); err != nil {
		return err
	}
	var wg sync.WaitGroup
	var perr atomic.Value
	for i, id := range ids {
		eventID := fmt.Sprintf("%s-evt-%08d", prefix, i)
		payload, sha := fx.event(id, eventID)
		rec := &kgo.Record{Topic: topic, Key: []byte(id), Value: payload}
		for _, h := range taskevent.Headers(eventID, taskevent.TypeTaskCreated, 0, sha, "") {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: h[0], Value: []byte(h[1])})
		}
		wg.Add(1)
		kcl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
			defer wg.Done()
			if err != nil {
				perr.Store(err)
			}
		})
	}
	wg.Wait()
	if err, ok := perr.Load().(error); ok {
		return fmt.Errorf("produce events: %w", err)
	}
	return nil
}

// copyTasks inserts queued tasks (version 0) and their inputs.
func copyTasks(ctx context.Context, pool *pgxpool.Pool, fx *fixtures, ids []string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		now := time.Now()
		i := 0
		_, err := tx.CopyFrom(ctx, pgx.Identifier{"task"},
			[]string{"task_id", "request_fingerprint", "status", "version", "attempt", "output_format", "input_sha256", "input_size", "created_at", "updated_at"},
			pgx.CopyFromFunc(func() ([]any, error) {
				if i >= len(ids) {
					return nil, nil
				}
				i++
				return []any{ids[i-1], fx.fingerprint, "queued", int64(0), int32(0), "jcs", fx.inputSHA, fx.inputSize, now, now}, nil
			}))
		if err != nil {
			return fmt.Errorf("copy tasks: %w", err)
		}
		i = 0
		_, err = tx.CopyFrom(ctx, pgx.Identifier{"task_input"}, []string{"task_id", "document"},
			pgx.CopyFromFunc(func() ([]any, error) {
				if i >= len(ids) {
					return nil, nil
				}
				i++
				return []any{ids[i-1], fx.doc}, nil
			}))
		if err != nil {
			return fmt.Errorf("copy task inputs: %w", err)
		}
		return nil
	})
}

// fillPgbenchTasks writes the queued tasks pgw-<run>-<n> (n from 1) that
// the pgbench worker script takes one by one from bench_pgw_seq.
func fillPgbenchTasks(ctx context.Context, pool *pgxpool.Pool, fx *fixtures, run, n int) error {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("pgw-%d-%d", run, i+1)
	}
	if err := copyTasks(ctx, pool, fx, ids); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, "SELECT setval('bench_pgw_seq', 1, false)")
	return err
}

// workerScript is the worker's database work for one task on its batch path
// (consumers/worker batch.go: the intake transaction, then the completion
// transaction; a batch sends these statements for all of its records) as a
// pgbench script. It takes the next task from a sequence
// (one extra, trivial statement the worker does not have) and leaves out
// everything that is not SQL: Kafka, canonicalization, the artifact file.
func workerScript(fx *fixtures, run int) string {
	_, createdSHA := fx.event(phTask, phOutbox)
	id := func(kind string) string { return fmt.Sprintf("'pgw-%s%d-' || :n::text", kind, run) }
	r := strings.NewReplacer(
		"$TASK", fmt.Sprintf("'pgw-%d-' || :n::text", run),
		"$EVT", id("evt-"),
		"$EFF", id("eff-"),
		"$OUT", id("out-"),
		"$SHA", "'"+createdSHA+"'",
		"$ASHA", "'"+fx.inputSHA+"'",
		"$ASIZE", fmt.Sprint(fx.inputSize),
		"$PAYLOAD", sqlText(string(fx.completed)),
		"$PSHA", "'"+canon.SHA256Hex(fx.completed)+"'",
		"$COLS", "task_id, status, version, attempt, output_format, input_sha256, input_size, artifact_sha256, artifact_size, terminal_error_code, created_at, updated_at, completed_at",
	)
	return r.Replace(`SELECT nextval('bench_pgw_seq') AS n \gset
BEGIN;
INSERT INTO inbox_message (consumer_name, message_id, payload_sha256, state) VALUES ('pgbench-worker', $EVT, $SHA, 'processing') ON CONFLICT (consumer_name, message_id) DO NOTHING;
UPDATE task SET status = 'running', version = version + 1, attempt = attempt + 1, updated_at = now() WHERE task_id = $TASK AND status = 'queued' AND version = 0 RETURNING $COLS, (SELECT document FROM task_input WHERE task_input.task_id = task.task_id);
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size) VALUES ($EFF, $TASK, 1, 'artifact.put', $EFF, 'artifact://' || $EFF, 'started', $ASHA, $ASIZE) ON CONFLICT DO NOTHING RETURNING effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size, observed_result_sha256, error_code, updated_at;
END;
BEGIN;
UPDATE inbox_message SET state = 'completed', result_json = '{"artifact_sha256":"x","task_version":2}'::jsonb, completed_at = now(), last_seen_at = now() WHERE consumer_name = 'pgbench-worker' AND message_id = $EVT AND state = 'processing';
UPDATE task SET status = 'completed', version = version + 1, artifact_sha256 = $ASHA, artifact_size = $ASIZE, completed_at = now(), updated_at = now() WHERE task_id = $TASK AND status = 'running' AND version = 1 RETURNING $COLS;
UPDATE effect_ledger SET state = 'verified', observed_result_sha256 = COALESCE($ASHA, observed_result_sha256), error_code = COALESCE(NULL, error_code), updated_at = now() WHERE effect_id = $EFF AND state = 'started';
INSERT INTO outbox_event (outbox_id, aggregate_id, aggregate_version, event_type, payload, payload_sha256) VALUES ($OUT, $TASK, 2, 'TaskCompleted', $PAYLOAD, $PSHA);
END;
`)
}

// workerOnce runs a worker in process over topic until n tasks are
// processed. It returns the steady rate (tasks/s from the first processed
// task to the last), the seconds until the first and the mean seconds one
// record took (converge_worker_processing_seconds).
func workerOnce(ctx context.Context, e *env, dbURL, topic, group string, run, n int) (rate, join, record float64, err error) {
	// The worker's pool as `converge worker` opens it (dbpool: pgxpool
	// defaults and converge's session settings).
	pool, err := dbpool.New(ctx, dbURL, "converge-bench")
	if err != nil {
		return 0, 0, 0, err
	}
	defer pool.Close()
	store, err := artifact.Open(filepath.Join(e.dir, fmt.Sprintf("artifacts-worker-%d", run)), nil)
	if err != nil {
		return 0, 0, 0, err
	}
	reg := prometheus.NewRegistry()
	w, err := worker.New(worker.Config{Pool: pool, Brokers: e.brokers, Topic: topic, Group: group, ArtifactStore: store,
		Concurrency: e.cfg.WorkerConcurrency, Logger: e.log.With("component", "worker"), Registerer: reg})
	if err != nil {
		return 0, 0, 0, err
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- w.Run(wctx) }()
	var first time.Time
	limit := time.Now().Add(30 * time.Minute)
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		got := counter(reg, "converge_worker_messages_total", "outcome", worker.OutcomeProcessed)
		if got >= 1 && first.IsZero() {
			first = time.Now()
		}
		if got >= float64(n) {
			break
		}
		if failed := counter(reg, "converge_worker_messages_total", "outcome", worker.OutcomeFailed); failed > 0 {
			return 0, 0, 0, fmt.Errorf("worker: %v records failed (see the components log)", failed)
		}
		select {
		case err := <-done:
			return 0, 0, 0, fmt.Errorf("worker stopped after %v of %d tasks: %v", got, n, err)
		case <-ctx.Done():
			return 0, 0, 0, ctx.Err()
		case <-t.C:
		}
		if time.Now().After(limit) {
			return 0, 0, 0, fmt.Errorf("worker: %v of %d tasks after 30 minutes", got, n)
		}
	}
	end := time.Now()
	cancel()
	<-done
	join = first.Sub(start).Seconds()
	if sum, count := histogram(reg, "converge_worker_processing_seconds"); count > 0 {
		record = sum / float64(count)
	}
	if n <= 1 || !end.After(first) {
		return float64(n) / end.Sub(start).Seconds(), join, record, nil
	}
	return float64(n-1) / end.Sub(first).Seconds(), join, record, nil
}

// counter reads the value of a counter (with one label pair) from reg.
func counter(reg *prometheus.Registry, name, label, value string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// partitionsPerPoll reads the n records of topic from the start with
// PollRecords(500), as the worker polls, and returns the mean number of
// partitions per poll.
func partitionsPerPoll(ctx context.Context, brokers []string, topic string, n int) (float64, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	polls, parts, got := 0, 0, 0
	for got < n && ctx.Err() == nil {
		fs := cl.PollRecords(ctx, 500)
		seen := map[int32]bool{}
		fs.EachRecord(func(r *kgo.Record) {
			seen[r.Partition] = true
			got++
		})
		if len(seen) > 0 {
			polls++
			parts += len(seen)
		}
	}
	if polls == 0 {
		return 0, fmt.Errorf("no records polled from %s", topic)
	}
	return round2(float64(parts) / float64(polls)), nil
}

// histogram reads the sum and count of a histogram without labels from reg.
func histogram(reg *prometheus.Registry, name string) (float64, uint64) {
	mfs, err := reg.Gather()
	if err != nil {
		return 0, 0
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleSum(), h.GetSampleCount()
		}
	}
	return 0, 0
}

// artifactRate measures the artifact store alone as the worker uses it for
// one task: Head (absent), Put (one file written and fsynced, directory
// fsynced), Observe (read back and hash), with clients goroutines, n
// artifacts in all. It returns artifacts/s.
func artifactRate(dir string, fx *fixtures, clients, n int) (float64, error) {
	store, err := artifact.Open(dir, nil)
	if err != nil {
		return 0, err
	}
	data, err := canon.Transform(fx.doc)
	if err != nil {
		return 0, err
	}
	var next atomic.Int64
	var firstErr atomic.Value
	start := time.Now()
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for {
				i := int(next.Add(1))
				if i > n {
					return
				}
				id := fmt.Sprintf("probe-%08d", i)
				token := artifact.Token(id, 1)
				_, _ = store.Head(token)
				if _, err := store.Put(token, id, 1, data); err != nil {
					firstErr.Store(err)
					return
				}
				if _, err := store.Observe(token); err != nil {
					firstErr.Store(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// fdatasyncRate writes 4 KiB at the start of a file and fdatasyncs it in a
// loop for about a second, and returns syncs/s.
func fdatasyncRate(path string) (float64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer os.Remove(path)
	defer f.Close()
	buf := make([]byte, 4096)
	start := time.Now()
	n := 0
	for time.Since(start) < time.Second {
		buf[0] = byte(n)
		if _, err := f.WriteAt(buf, 0); err != nil {
			return 0, err
		}
		if err := syscall.Fdatasync(int(f.Fd())); err != nil {
			return 0, err
		}
		n++
	}
	return round2(float64(n) / time.Since(start).Seconds()), nil
}
