package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/consumergroup"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
)

// Batches (issue 11). The polls queued for a partition are handed to the
// worker as one batch, up to MaxPollRecords (internal/consumergroup). A run
// of consecutive records that are fresh driving events of distinct tasks
// goes through one intake transaction and one completion transaction for the
// whole run, instead of two per record; each record's inbox row, task start
// and effect row are still written, in the intake transaction, before its
// effect, and each offset is still committed only after the transaction
// recording its outcome. A run goes through a group of runs (groups.go):
// the runs of other partitions submitted at the same time share its
// transactions. A run may be a single record: it shares a group's
// transactions when others wait with it. Anything off the happy path — a
// redelivery, a task not queued or not visible yet, an effect to resume, a
// failed effect, a concurrent change — sends the records concerned through
// the per-record path (processRecord), which resumes each from its durable
// state; so every rule of the package doc holds for batches too. Batching is off while fault
// points are armed (their passes are counted per record).

// notFresh makes a run's intake transaction roll back: the record at idx
// (of the jobs given to intakeRun) needs the per-record path.
type notFresh struct{ idx int }

func (e notFresh) Error() string {
	return fmt.Sprintf("record %d of the run is off the batch path", e.idx)
}

// processBatch processes the records of one partition's batch in order and
// returns how many of them, from the first, have durable outcomes. Runs of
// fresh records go through groups of runs (groups.go, processGroup); the
// others, and what a group leaves undone, through processRecord; at most
// Concurrency records (or runs) of all partitions at once. It stops
// early when ctx is cancelled (revoke, loss, shutdown).
func (w *Worker) processBatch(ctx context.Context, b consumergroup.Batch, sem chan struct{}) int {
	recs := b.Records
	for i := 0; i < len(recs); {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return i
		}
		if run, span := w.runOf(recs[i:]); len(run) > 0 {
			// The run goes through transactions shared with the runs of
			// other partitions (groups.go); what it leaves undone goes
			// through the per-record path, in order.
			done := w.groups.do(ctx, run)
			if done == nil {
				<-sem
				return i // ctx ended and nothing of the run was written (groups.go)
			}
			n := w.perRecord(ctx, b.Client, run, done)
			<-sem
			// Records the run skipped (events the worker ignores) are done
			// once every job before them is.
			end := span
			if n < len(run) {
				end = run[n].idx
			}
			// The first n jobs are among them: the rest were ignored.
			if end > n {
				w.m.messages.WithLabelValues(OutcomeIgnored).Add(float64(end - n))
			}
			i += end
			if n < len(run) {
				return i
			}
			continue
		}
		ok := ctx.Err() == nil && w.processRecord(ctx, b.Client, recs[i])
		<-sem
		if !ok {
			return i
		}
		i++
	}
	return len(recs)
}

// runOf returns the jobs of the longest prefix of recs (at most
// MaxBatchRecords jobs) that the batch path may take, and the length of that
// prefix: TaskCreated or TaskRedriveRequested records that pass the contract
// checks, of distinct tasks, while no fault point is armed, with the records
// between them that the worker ignores (an event type in the header that
// does not drive a task, such as the TaskCompleted events sharing the topic:
// processRecord's OutcomeIgnored, which writes nothing).
func (w *Worker) runOf(recs []*kgo.Record) (run []*job, span int) {
	if w.cfg.MaxBatchRecords < 2 || w.faults.String() != "" {
		return nil, 0
	}
	tasks := map[string]bool{}
	for i, r := range recs {
		if len(run) == w.cfg.MaxBatchRecords {
			break
		}
		t, ok := eventType(r)
		if !ok {
			break
		}
		if !drives(t) {
			continue
		}
		hdr := headers(r)
		ev, err := verifyRecord(r, hdr)
		if err != nil || !drives(ev.EventType) || tasks[ev.TaskID] {
			break
		}
		tasks[ev.TaskID] = true
		run = append(run, &job{rec: r, ev: ev, sha: hdr[taskevent.HeaderPayloadSHA256], idx: i})
		span = i + 1
	}
	return run, span
}

// processGroup processes a group of fresh records (the runs of one or more
// partitions, of distinct tasks: groups.go) through one intake transaction,
// the effects, and one completion transaction, and returns each job's
// outcome when it is durable ("" when it is not: the per-record path takes
// that job). When the intake fails, nothing of the group was written (or,
// when the COMMIT's answer was lost, all of its intake, which the
// per-record path resumes) and every outcome is ""; stale is then the
// index of the job that is not fresh when that was why, and -1 otherwise
// (and when the intake committed).
func (w *Worker) processGroup(ctx context.Context, run []*job) (done []string, stale int) {
	start := time.Now()
	done = make([]string, len(run))
	actx, cancel := context.WithTimeout(ctx, w.cfg.AttemptTimeout)
	err := dbpool.InPipelinedTx(actx, w.pool, func(tx *dbpool.PipelinedTx) error { return w.intakeRun(actx, tx, run) })
	cancel()
	if err != nil {
		var nf notFresh
		if errors.As(err, &nf) {
			return done, nf.idx
		}
		w.log.WarnContext(ctx, "intake of a group of runs failed; its records are processed one by one", recordsAttr(run), slog.Any("err", err))
		return done, -1
	}
	w.m.batched.Add(float64(len(run)))
	w.m.groups.Observe(float64(len(run)))
	w.m.effects.WithLabelValues(string(ledger.KindArtifactPut), string(ledger.Started)).Add(float64(len(run)))
	// The effects, of distinct tasks, at most Concurrency at once.
	verified := make([]*verifiedEffect, len(run))
	var wg sync.WaitGroup
	sem := make(chan struct{}, w.cfg.Concurrency)
	// The run's objects, written together: their fsyncs share the
	// filesystem's flushes (PutManyUnsynced); each is then read back.
	items := make([]artifact.Item, len(run))
	for i, j := range run {
		items[i] = artifact.Item{Token: j.effect.Token, TaskID: j.task.TaskID, Attempt: j.effect.Attempt, Data: j.artifact}
	}
	_, writeErrs := w.store.PutManyUnsynced(items)
	for i, j := range run {
		j.written, j.writeErr = true, writeErrs[i]
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			actx, cancel := context.WithTimeout(ctx, w.cfg.AttemptTimeout)
			defer cancel()
			v, outcome, err := w.perform(actx, j)
			switch {
			case err != nil:
				// left for the per-record path, which resumes the effect
			case outcome != "":
				done[i] = outcome // an outcome of the effect path (failed)
			default:
				verified[i] = &v
			}
		})
	}
	wg.Wait()
	// One directory fsync makes the names of the run's artifacts durable
	// before any of them is recorded verified; if it fails, none is, and the
	// per-record path (which syncs again) takes them.
	if err := w.store.SyncObjects(); err != nil {
		w.log.WarnContext(ctx, "artifact store sync of a group of runs failed; its records are processed one by one", recordsAttr(run), slog.Any("err", err))
		clear(verified)
	}
	var ready []*job
	var readyV []verifiedEffect
	for i, v := range verified {
		if v != nil {
			ready, readyV = append(ready, run[i]), append(readyV, *v)
		}
	}
	if len(ready) > 0 {
		actx, cancel := context.WithTimeout(ctx, w.cfg.AttemptTimeout)
		var completed []taskevent.Task
		err := dbpool.InPipelinedTx(actx, w.pool, func(tx *dbpool.PipelinedTx) error {
			var err error
			completed, err = w.completeRun(actx, tx, ready, readyV)
			return err
		})
		cancel()
		if err != nil {
			w.log.WarnContext(ctx, "completion of a group of runs failed; its records are completed one by one", recordsAttr(ready), slog.Any("err", err))
		} else {
			k := 0
			for i, v := range verified {
				if v != nil {
					w.completed(ctx, completed[k], v.from, v.sha, v.size)
					done[i] = OutcomeProcessed
					k++
				}
			}
		}
	}
	for _, outcome := range done {
		if outcome != "" {
			w.m.messages.WithLabelValues(outcome).Inc()
			w.m.processing.Observe(time.Since(start).Seconds())
		}
	}
	return done, -1
}

// perRecord runs processRecord for the jobs of run whose outcome is not
// durable yet (done[i] empty), in order, and returns
// how many jobs from the first have durable outcomes.
func (w *Worker) perRecord(ctx context.Context, cl *kgo.Client, run []*job, done []string) int {
	for i, j := range run {
		if done[i] != "" {
			continue
		}
		if ctx.Err() != nil || !w.processRecord(ctx, cl, j.rec) {
			// Given up: the run's intake may have leased the rest.
			for k := i + 1; k < len(run); k++ {
				if done[k] == "" {
					w.releaseLease(run[k].rec, w.log)
				}
			}
			if ctx.Err() != nil {
				w.releaseLease(j.rec, w.log)
			}
			return i
		}
	}
	return len(run)
}

// intakeRun is the intake of a run in tx: for every record, the inbox row
// registered and the task started, reading its document (one round trip
// for all, BEGIN included, two statements a record); the documents
// canonicalized; the effect rows planned (one more round trip, a statement
// a record: ledger.QueuePlanNew); COMMIT is the third, sent by
// dbpool.InPipelinedTx when intakeRun returns nil. It fails with notFresh, and the transaction is
// rolled back, when a record is a redelivery, its task does not start (not
// queued, or not visible yet) or starts an attempt other than its first,
// has no document or an effect recorded already, or its document does not
// canonicalize.
//
// Why the first attempt only: the per-record path reads the task's live
// effect (ledger.Live) to resume an earlier attempt's effect instead of
// writing a second artifact. Put effects are written only by the worker,
// with an attempt no higher than the task's, which only the start raises
// (from 0 at creation); so a task this transaction starts at attempt 1 can
// have no put effect but the one of attempt 1, whose identity the plan's
// insert finds (ON CONFLICT): no Live read is needed. A re-opened or
// re-driven task (attempt 2 or more) takes the per-record path.
func (w *Worker) intakeRun(ctx context.Context, tx *dbpool.PipelinedTx, run []*job) error {
	n := len(run)
	var (
		inserted = make([]bool, n)
		started  = make([]task.Changed, n)
		docs     = make([][]byte, n)
		docFound = make([]bool, n)
	)
	b := &pgx.Batch{}
	for i, j := range run {
		inbox.QueueRegister(b, w.cfg.Group, j.ev.EventID, j.sha, w.lease, &inserted[i])
		task.QueueStartIfQueuedReadingDocument(b, j.ev.TaskID, j.ev.TaskVersion, &started[i], &docs[i], &docFound[i])
	}
	if err := tx.SendBatch(ctx, b); err != nil {
		return fmt.Errorf("intake of %d records: %w", n, err)
	}
	want := make([]ledger.Effect, n)
	for i, j := range run {
		if !inserted[i] || !started[i].Applied || started[i].Task.Attempt != 1 || !docFound[i] {
			return notFresh{i}
		}
		out, sha, err := task.CanonicalInput(docs[i], started[i].Task.InputSHA256)
		if err != nil {
			return notFresh{i}
		}
		j.task, j.artifact = started[i].Task, out
		want[i] = ledger.NewPut(j.task.TaskID, j.task.Attempt, sha, int64(len(out)))
	}
	effs := make([]ledger.Effect, n)
	planned := make([]bool, n)
	b = &pgx.Batch{}
	for i := range run {
		ledger.QueuePlanNew(b, want[i], &effs[i], &planned[i])
	}
	if err := tx.SendBatch(ctx, b); err != nil {
		return fmt.Errorf("plan %d effects: %w", n, err)
	}
	for i, j := range run {
		if !planned[i] {
			return notFresh{i}
		}
		j.effect, j.planned = effs[i], true
	}
	return nil
}

// completeRun is the completion of the verified jobs of a run in tx, as
// completeInTx for each (inbox -> completed, task running -> completed,
// effect -> verified: one round trip for all, BEGIN included), then their
// TaskCompleted outbox rows and COMMIT (one more, one statement:
// outbox.QueueInsertMany). Any
// transition that does not apply is errConcurrentChange; a second verified
// artifact of a task violates ledger.OneVerifiedIndex. Either rolls the
// transaction back, and the jobs go through the per-record path.
func (w *Worker) completeRun(ctx context.Context, tx *dbpool.PipelinedTx, jobs []*job, vs []verifiedEffect) ([]taskevent.Task, error) {
	n := len(jobs)
	finished := make([]bool, n)
	completed := make([]task.Changed, n)
	verified := make([]bool, n)
	b := &pgx.Batch{}
	for i, j := range jobs {
		v := vs[i]
		if err := inbox.QueueFinish(b, w.cfg.Group, j.ev.EventID, inbox.Completed,
			map[string]any{"task_version": j.task.Version + 1, "artifact_sha256": v.sha}, &finished[i]); err != nil {
			return nil, err
		}
		task.QueueCompleteIfRunning(b, j.task.TaskID, j.task.Version, v.sha, v.size, &completed[i])
		if v.from != ledger.Verified {
			ledger.QueueMarkVerified(b, j.effect.EffectID, v.from, &v.sha, &verified[i])
		}
	}
	if err := tx.SendBatch(ctx, b); err != nil {
		return nil, fmt.Errorf("complete %d tasks: %w", n, err)
	}
	out := make([]taskevent.Task, n)
	rows := make([]outbox.Row, n)
	for i, j := range jobs {
		if !finished[i] || !completed[i].Applied || (vs[i].from != ledger.Verified && !verified[i]) {
			return nil, fmt.Errorf("complete task %s: %w", j.task.TaskID, errConcurrentChange)
		}
		out[i] = completed[i].Task
		ev, err := outbox.NewEvent(taskevent.TypeTaskCompleted, out[i], out[i].UpdatedAt)
		if err != nil {
			return nil, err
		}
		if rows[i], err = outbox.RowOf(&ev); err != nil {
			return nil, err
		}
	}
	b = &pgx.Batch{}
	outbox.QueueInsertMany(b, rows)
	if err := tx.SendBatchAndCommit(ctx, b); err != nil {
		return nil, fmt.Errorf("insert %d TaskCompleted events and commit: %w", n, err)
	}
	return out, nil
}
