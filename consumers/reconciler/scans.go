package reconciler

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/cdc"
	"github.com/converge-run/converge/consumers/deadletter"
	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/inbox"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/projections/taskview"
	"github.com/converge-run/converge/services/api/idempotency"
)

// scans runs the scans after the effect scans (see Pass). A failing scan
// is logged and counted as an error; the others still run.
func (r *Reconciler) scans(ctx context.Context, res *Result) error {
	var errs []error
	for _, scan := range []struct {
		name string
		fn   func(context.Context, *Result) error
	}{
		{"inbox leases", r.scanInbox},
		{"stuck tasks", r.scanTasks},
		{"idempotency records", r.scanIdempotency},
		{"outbox", r.scanOutbox},
		{"dead letters", r.scanDeadLetters},
		{"task views", r.scanCache},
		{"artifact leftovers", r.sweepLeftovers},
		{"retention", r.scanRetention},
	} {
		if err := scan.fn(ctx, res); err != nil {
			r.log.WarnContext(ctx, "reconciler scan failed", slog.String("scan", scan.name), slog.Any("err", err))
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// scanRetention removes what is kept no longer (issue 13, seed 3.3), in
// batches of BatchSize:
//
//  1. idempotency records past expires_at whose task is settled
//     (idempotency.Purge);
//  2. outbox rows published (or parked and decided) more than
//     OutboxRetention ago, with their inbox rows of every consumer, in one
//     transaction (purgeOutbox): the event is gone from Kafka too, so no
//     delivery can need its inbox row any more; a row with an inbox row
//     processing stays, with that inbox row, until the inbox scan has
//     released it;
//  3. terminal tasks last updated more than TaskRetention ago (purgeTasks).
//
// Each step takes batch after batch while they come back full, until the
// pass has spent RetentionBudget on retention (then the next pass goes on):
// one batch per pass was a ceiling of BatchSize per Interval, 20 tasks/s
// at the defaults, below the rate a deployment creates tasks at, so the
// tables grew without end (issue 11).
func (r *Reconciler) scanRetention(ctx context.Context, res *Result) error {
	deadline := time.Now().Add(r.cfg.RetentionBudget)
	more := func(n int) bool { return n >= r.cfg.BatchSize && time.Now().Before(deadline) && ctx.Err() == nil }
	// drain runs purge, a batch at a time, while more: the rows it
	// removed are counted as action in the metrics and in *count.
	drain := func(purge func() (int64, error), action string, count *int) (int64, error) {
		var total int64
		for {
			k, err := purge()
			if err != nil {
				return total, err
			}
			r.m.actions.WithLabelValues(action).Add(float64(k))
			*count += int(k)
			total += k
			if !more(int(k)) {
				return total, nil
			}
		}
	}
	var m, in int64
	n, err := drain(func() (int64, error) { return idempotency.Purge(ctx, r.pool, r.cfg.BatchSize) },
		ActionIdempotencyExpired, &res.IdempotencyExpired)
	if err != nil {
		return err
	}
	// Rows kept by a batch (an inbox row processing, or changed since
	// read) are left out of the next ones, so that they cannot fill them.
	var kept []string
	for {
		ids, err := r.backlog.Purgeable(ctx, r.pool, r.cfg.OutboxRetention, r.cfg.BatchSize, kept)
		if err != nil {
			return err
		}
		i, gone, err := purgeOutbox(ctx, r.pool, ids)
		if err != nil {
			return err
		}
		k := int64(len(gone))
		r.m.actions.WithLabelValues(ActionOutboxPurged).Add(float64(k))
		r.m.actions.WithLabelValues(ActionInboxPurged).Add(float64(i))
		res.OutboxPurged += int(k)
		res.InboxPurged += int(i)
		m, in = m+k, in+i
		full := more(len(ids))
		if len(gone) < len(ids) {
			kept = append(kept, slices.DeleteFunc(ids, func(id string) bool { return slices.Contains(gone, id) })...)
		}
		if !full {
			break
		}
	}
	dl, err := drain(func() (int64, error) {
		return deadletter.DeleteOrphans(ctx, r.pool, r.cfg.TaskRetention, r.cfg.BatchSize)
	},
		ActionDeadLetterPurged, &res.DeadLettersPurged)
	if err != nil {
		return err
	}
	if n > 0 || m > 0 || in > 0 || dl > 0 {
		r.log.InfoContext(ctx, "retention", slog.Int64("idempotency_records", n), slog.Int64("outbox_rows", m), slog.Int64("inbox_rows", in),
			slog.Int64("orphan_dead_letters", dl))
	}
	for {
		examined, err := r.purgeTasks(ctx, res)
		if err != nil {
			return err
		}
		if !more(examined) {
			break
		}
	}
	if ctx.Err() != nil {
		return nil // stopping: the gauge keeps its last value
	}
	left, err := task.CountExpired(ctx, r.pool, r.cfg.TaskRetention, expiredCountCap)
	if err != nil {
		return err
	}
	r.m.expiredTasks.Set(float64(left))
	return nil
}

// expiredCountCap bounds the count behind converge_reconciler_expired_tasks
// (task.CountExpired reads at most this many index entries per pass).
const expiredCountCap = 10001

// purgeTasks examines at most BatchSize terminal tasks last updated more
// than TaskRetention ago (task.Expired: oldest first, from a cursor past
// the tasks kept by earlier batches, back to the start once a batch reaches
// the end) and removes those nothing needs any more (purgeBatch), among
// the ones no other reconciler is removing (claimTasks: two reconcilers
// walking the same tasks take alternate batches, where the second used to
// wait for the first's locks and find its batch gone). It returns how many
// it examined.
func (r *Reconciler) purgeTasks(ctx context.Context, res *Result) (int, error) {
	ids, next, err := task.Expired(ctx, r.pool, r.cfg.TaskRetention, r.retentionCursor, r.cfg.BatchSize)
	if err != nil {
		return 0, err
	}
	if len(ids) < r.cfg.BatchSize {
		r.retentionCursor = task.Cursor{}
	} else {
		r.retentionCursor = next
	}
	if len(ids) == 0 {
		return 0, nil
	}
	claim, err := claimTasks(ctx, r.pool, ids)
	if err != nil {
		return 0, err
	}
	defer claim.release()
	if n := len(ids) - len(claim.ids); n > 0 {
		r.log.DebugContext(ctx, "expired tasks claimed by another reconciler", slog.Int("tasks", n))
	}
	r.purgeBatch(ctx, res, claim.ids)
	return len(ids), nil
}

// purgeBatch removes the tasks of ids past TaskRetention that nothing
// needs any more (task.Holds, and no inbox row of their events
// processing), a batch at a time:
//
//  1. each artifact of them that may be in the store is deleted under its
//     own artifact.delete ledger entry, written before the file is removed
//     and verified by observing the store hold nothing under the put's
//     token (ledger.DeleteArtifacts: the batch's ledger writes together);
//     a crash between any two steps leaves the deletion started, and the
//     next pass resumes it with the same token; a task whose deletion
//     failed stays for the next pass, the others go on;
//  2. one transaction removes the tasks whose deletions are verified, with
//     their dead letters (resolved or replayed), inbox rows, effects,
//     outbox rows and inputs, after checking the holds again under the
//     locks (removeTasks);
//  3. their Redis views are removed (best effort: a failure is counted as
//     an error and the view expires with its TTL).
//
// Kept tasks are counted in TasksKept and examined again on a later walk.
func (r *Reconciler) purgeBatch(ctx context.Context, res *Result, ids []string) {
	if len(ids) == 0 {
		return
	}
	fail := func(msg string, tasks int, err error) {
		if ctx.Err() != nil {
			return // stopping: the next start resumes
		}
		r.log.WarnContext(ctx, msg, slog.Int("tasks", tasks), slog.Any("err", err))
		r.act(res, ActionError, nil)
	}
	holds, err := task.Holds(ctx, r.pool, ids, r.cfg.TaskRetention)
	if err != nil {
		fail("task retention", len(ids), err)
		return
	}
	var candidates []string
	for _, id := range ids {
		hold, found := holds[id]
		switch {
		case !found:
			// removed meanwhile (another reconciler)
		case hold != "" && hold != task.HoldArtifact:
			r.log.DebugContext(ctx, "expired task kept", slog.String("task_id", id), slog.String("reason", hold))
			res.TasksKept++
		default:
			candidates = append(candidates, id)
		}
	}
	if len(candidates) == 0 {
		return
	}
	msgs, err := taskMessages(ctx, r.pool, candidates, deadletter.MessagesOfTasks)
	if err != nil {
		fail("task retention", len(ids), err)
		return
	}
	busy, err := inbox.ProcessingOf(ctx, r.pool, messagesOf(msgs, candidates))
	if err != nil {
		fail("task retention", len(ids), err)
		return
	}
	var ready, withArtifacts []string
	for _, id := range candidates {
		if anyBusy(msgs[id], busy) {
			r.log.DebugContext(ctx, "expired task kept", slog.String("task_id", id), slog.String("reason", holdInboxProcessing))
			res.TasksKept++
			continue
		}
		if holds[id] == task.HoldArtifact {
			withArtifacts = append(withArtifacts, id)
		}
		ready = append(ready, id)
	}
	if len(withArtifacts) > 0 {
		failed, err := r.deleteArtifacts(ctx, res, withArtifacts)
		if err != nil {
			fail("task retention: delete artifacts; resumed next pass", len(withArtifacts), err)
			return
		}
		ready = slices.DeleteFunc(ready, func(id string) bool { return failed[id] })
	}
	rm, err := removeTasks(ctx, r.pool, ready, r.cfg.TaskRetention)
	if err != nil && len(ready) > 1 && dbpool.IsStatementError(err) {
		// One task may fail the batch's transaction: each alone, so that
		// it fails alone and the others go (not after a failure of the
		// connection or the context: that would fail each the same way).
		r.log.WarnContext(ctx, "task retention: remove a batch; each task alone", slog.Int("tasks", len(ready)), slog.Any("err", err))
		rm, err = removed{kept: map[string]string{}}, nil
		for _, id := range ready {
			one, oneErr := removeTasks(ctx, r.pool, []string{id}, r.cfg.TaskRetention)
			if oneErr != nil && !dbpool.IsStatementError(oneErr) {
				err = oneErr // the ones removed so far are counted below
				break
			}
			if oneErr != nil {
				r.log.WarnContext(ctx, "task retention: remove task", slog.String("task_id", id), slog.Any("err", oneErr))
				r.act(res, ActionError, nil)
				continue
			}
			rm.add(one)
		}
	}
	if err != nil {
		fail("task retention: remove tasks", len(ready)-len(rm.tasks)-len(rm.kept), err)
	}
	for _, id := range ready {
		switch hold, ok := rm.kept[id]; {
		case !ok:
		case hold == "not_found":
			// removed meanwhile (another reconciler)
			r.log.DebugContext(ctx, "expired task gone meanwhile", slog.String("task_id", id))
		default:
			r.log.InfoContext(ctx, "expired task kept: it changed since it was read", slog.String("task_id", id), slog.String("reason", hold))
			res.TasksKept++
		}
	}
	r.m.actions.WithLabelValues(ActionInboxPurged).Add(float64(rm.inbox))
	res.InboxPurged += int(rm.inbox)
	if len(rm.tasks) > 0 {
		r.log.InfoContext(ctx, "tasks removed (retention)", slog.Int("tasks", len(rm.tasks)), slog.Int64("effects", rm.effects),
			slog.Int64("outbox_rows", rm.outbox), slog.Int64("inbox_rows", rm.inbox), slog.Int64("dead_letters", rm.deadLetters),
			slog.Duration("older_than", r.cfg.TaskRetention))
	}
	for _, id := range rm.tasks {
		r.log.InfoContext(ctx, "task removed (retention)", slog.String("task_id", id), slog.Duration("older_than", r.cfg.TaskRetention))
		r.act(res, ActionTaskPurged, &res.TasksPurged)
		if r.cache != nil {
			if err := r.cache.Invalidate(ctx, id); err != nil {
				r.log.WarnContext(ctx, "task retention: remove the task's view; it expires with its TTL", slog.String("task_id", id), slog.Any("err", err))
				r.act(res, ActionError, nil)
			}
		}
	}
}

// deleteArtifacts deletes the artifacts of the tasks of ids that may still
// be in the store (ledger.UndeletedOf, ledger.DeleteArtifacts) and returns
// the tasks whose deletion failed (each logged and counted as an error):
// they stay for the next pass. err: the batch's read of its artifacts
// failed, and no task of ids may be removed now.
func (r *Reconciler) deleteArtifacts(ctx context.Context, res *Result, ids []string) (failed map[string]bool, err error) {
	puts, err := ledger.UndeletedOf(ctx, r.pool, ids)
	if err != nil {
		return nil, err
	}
	ds, errs := ledger.DeleteArtifacts(ctx, r.pool, r.store, r.cfg.Faults, puts)
	failed = map[string]bool{}
	notTried := 0
	for i, p := range puts {
		switch {
		case errors.Is(errs[i], ledger.ErrTaskGone):
			// removed meanwhile, with everything of it (another reconciler)
			r.log.DebugContext(ctx, "task retention: the task is gone", slog.String("task_id", p.TaskID))
			failed[p.TaskID] = true
		case errors.Is(errs[i], ledger.ErrNotTried):
			notTried++
			failed[p.TaskID] = true
		case errs[i] != nil:
			r.log.WarnContext(ctx, "task retention: delete artifact; resumed next pass", slog.String("task_id", p.TaskID),
				slog.String("token", p.Token), slog.Any("err", errs[i]))
			r.act(res, ActionError, nil)
			failed[p.TaskID] = true
		case ds[i].Verified:
			r.log.DebugContext(ctx, "artifact deleted (task retention)", slog.String("task_id", p.TaskID), slog.String("token", p.Token),
				slog.String("effect_id", ds[i].DeleteID))
			r.act(res, ActionArtifactDeleted, &res.ArtifactsDeleted)
		}
	}
	if notTried > 0 && ctx.Err() == nil {
		r.log.WarnContext(ctx, "task retention: artifacts not deleted after a failure of their batch; resumed next pass", slog.Int("artifacts", notTried))
	}
	return failed, nil
}

// holdInboxProcessing: an inbox row of one of the task's events is
// processing (inbox.ProcessingOf); the task is kept.
const holdInboxProcessing = "inbox_processing"

// leftoverSweepInterval is how often a pass removes the artifact store's
// crashed temporary files.
const leftoverSweepInterval = 10 * time.Minute

// sweepLeftovers removes the artifact store's temporary files older than
// artifact.LeftoverAge (Puts that crashed), at most every
// leftoverSweepInterval; the first pass of a reconciler sweeps at once.
func (r *Reconciler) sweepLeftovers(ctx context.Context, res *Result) error {
	if !r.lastSweep.IsZero() && time.Since(r.lastSweep) < leftoverSweepInterval {
		return nil
	}
	r.lastSweep = time.Now()
	n, err := r.store.RemoveLeftovers(artifact.LeftoverAge)
	res.LeftoversRemoved += n
	if n > 0 {
		r.log.InfoContext(ctx, "removed temporary files of crashed artifact writes", slog.Int("files", n), slog.Duration("older_than", artifact.LeftoverAge))
	}
	return err
}

// cacheKey is the Redis key of a task view.
func cacheKey(taskID string) string { return taskview.Key(taskID) }

// repaired counts one compare-and-set repair of a row (attrs name it) as
// the scans do: err is logged as fail and counted as an error; !ok (the
// row changed since it was read) is counted as skipped; otherwise done is
// logged and the repair counted as kind, and in *n.
func (r *Reconciler) repaired(ctx context.Context, res *Result, ok bool, err error, kind string, n *int, fail, done string, attrs ...any) {
	switch {
	case err != nil:
		r.log.WarnContext(ctx, fail, append(slices.Clip(attrs), slog.Any("err", err))...)
		r.act(res, ActionError, nil)
	case !ok:
		r.act(res, ActionSkipped, nil)
	default:
		r.log.InfoContext(ctx, done, attrs...)
		r.act(res, kind, n)
	}
}

func (r *Reconciler) act(res *Result, kind string, n *int) {
	r.m.actions.WithLabelValues(kind).Inc()
	switch kind {
	case ActionSkipped:
		res.Skipped++
	case ActionError:
		res.Errors++
	default:
		*n++
	}
}

// scanInbox finishes inbox rows left processing past InboxLease whose task
// is terminal: the delivery's outcome was decided by another delivery or a
// repair. Rows of tasks still queued or running are left to scanTasks,
// which re-drives the task; a redelivery resumes the processing row. A row
// whose message has no outbox row any more (removed by retention before
// the delivery registered it, as a late replay does) is removed
// (inbox.DeleteStale), counted as inbox_purged.
func (r *Reconciler) scanInbox(ctx context.Context, res *Result) error {
	rows, err := inbox.Stales(ctx, r.pool, r.cfg.InboxLease, taskevent.TerminalStatuses, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	for _, in := range rows {
		row := []any{slog.String("consumer", in.Consumer), slog.String("message_id", in.MessageID)}
		if in.TaskStatus == nil {
			ok, err := inbox.DeleteStale(ctx, r.pool, in)
			r.repaired(ctx, res, ok, err, ActionInboxPurged, &res.InboxPurged, "remove inbox row", "inbox row of a removed outbox row removed", row...)
			continue
		}
		ok, err := inbox.Release(ctx, r.pool, in, *in.TaskStatus)
		r.repaired(ctx, res, ok, err, ActionInboxReleased, &res.InboxReleased, "release inbox row", "inbox row released",
			append(row, slog.String("task_status", *in.TaskStatus))...)
	}
	return nil
}

// scanTasks re-drives tasks queued or running past TaskDeadline: a
// TaskRedriveRequested outbox event for the task's current version, written
// in a transaction that re-reads the task by compare-and-set on status and
// version (a task that moved meanwhile is skipped). The outbox's unique
// (task, version, type) allows one re-drive per task version.
func (r *Reconciler) scanTasks(ctx context.Context, res *Result) error {
	tasks, err := task.Stuck(ctx, r.pool, r.cfg.TaskDeadline, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	for _, t := range tasks {
		ok, err := redrive(ctx, r.pool, t)
		r.repaired(ctx, res, ok, err, ActionTaskRedriven, &res.TasksRedriven, "re-drive task", "task re-driven",
			slog.String("task_id", t.TaskID), slog.String("status", t.Status), slog.Int64("version", t.Version))
	}
	return nil
}

// scanIdempotency resolves idempotency records in_progress past
// locked_until from the task state, never assuming the first execution did
// not happen (seed 3.1): a record whose task exists becomes succeeded with
// the response the API gives for that task; a record without a task (the
// API writes both in one transaction, so none was created) is deleted so
// that the client's retry with the same key creates the task.
func (r *Reconciler) scanIdempotency(ctx context.Context, res *Result) error {
	recs, err := idempotency.Expired(ctx, r.pool, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	for _, rec := range recs {
		ok, err := resolveIdempotency(ctx, r.pool, rec)
		r.repaired(ctx, res, ok, err, ActionIdempotencyResolved, &res.IdempotencyResolved, "resolve idempotency record", "idempotency record resolved",
			slog.String("scope", rec.Scope), slog.String("key", rec.Key))
	}
	return nil
}

// scanOutbox reports outbox rows unpublished for longer than
// OutboxThreshold (gauges and a warning; outbox.Backlog) and the parked
// rows no one decided on (converge_outbox_parked_rows). With a Producer it
// republishes the rows unpublished past RepublishAfter (republish).
func (r *Reconciler) scanOutbox(ctx context.Context, res *Result) error {
	n, age, err := r.backlog.Unpublished(ctx, r.pool, r.cfg.OutboxThreshold)
	if err != nil {
		return err
	}
	r.m.outboxRows.Set(float64(n))
	r.m.outboxAge.Set(age.Seconds())
	res.OutboxUnpublished = n
	if n > 0 {
		r.log.WarnContext(ctx, "outbox rows unpublished past the threshold; is the relay running?",
			slog.Int("rows", n), slog.Duration("oldest_age", age), slog.Duration("threshold", r.cfg.OutboxThreshold))
	}
	parked, err := outbox.ParkedUndecided(ctx, r.pool)
	if err != nil {
		return err
	}
	r.m.outboxParked.Set(float64(parked))
	res.OutboxParked = parked
	if r.cfg.Producer != nil {
		return r.republish(ctx, res)
	}
	return nil
}

// republish produces the rows the slot did not deliver with their original
// records, in order, and marks the acknowledged ones published; a failed
// one keeps its error on the row and is tried again at the next pass, one
// refused for good (too large, invalid) is parked
// (cdc.RepublishUnpublished, also behind `converge outbox republish
// --unpublished`).
func (r *Reconciler) republish(ctx context.Context, res *Result) error {
	rep, err := cdc.RepublishUnpublished(ctx, r.cfg.Producer, r.pool, &r.backlog, r.cfg.Topic, r.cfg.RepublishAfter, r.cfg.BatchSize)
	for _, f := range rep.Failed {
		if f.Parked {
			r.log.ErrorContext(ctx, "republish of an outbox row was refused for good; the row is parked (converge outbox show|republish|discard)",
				slog.String("outbox_id", f.ID), slog.Any("err", f.Err))
			continue
		}
		r.log.WarnContext(ctx, "republish of an outbox row failed; tried again next pass", slog.String("outbox_id", f.ID), slog.Any("err", f.Err))
		r.act(res, ActionError, nil)
	}
	if err != nil || len(rep.Republished) == 0 {
		return err
	}
	r.log.WarnContext(ctx, "outbox rows the relay did not deliver were republished by the reconciler",
		slog.Int("rows", len(rep.Republished)), slog.Duration("older_than", r.cfg.RepublishAfter), slog.String("first", rep.Republished[0]))
	for range rep.Republished {
		r.act(res, ActionOutboxRepublished, &res.OutboxRepublished)
	}
	return nil
}

// scanDeadLetters resolves up to BatchSize dead letters parked or refused
// whose task has completed since (deadletter.Store.ResolveCompleted), then
// refreshes converge_deadletter_unresolved.
func (r *Reconciler) scanDeadLetters(ctx context.Context, res *Result) error {
	store := deadletter.NewStore(r.pool)
	resolved, err := store.ResolveCompleted(ctx, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	for _, d := range resolved {
		r.log.InfoContext(ctx, "dead letter resolved: its task completed since", slog.Int64("dead_letter_id", d.ID),
			slog.String("task_id", d.TaskID), slog.String("from", d.From))
		r.act(res, ActionDeadLetterResolved, &res.DeadLettersResolved)
	}
	n, err := store.Unresolved(ctx)
	if err != nil {
		return err
	}
	r.m.unresolved.Set(float64(n))
	return nil
}

// scanCache compares the Redis views of up to BatchSize tasks (a cursor on
// task id walks the whole table across passes) with their database
// versions and replaces a view older than the database by the database
// snapshot (Cache.Put, whose Lua compare-and-set never regresses a view).
// Absent views are left absent: the next read back-fills them.
func (r *Reconciler) scanCache(ctx context.Context, res *Result) error {
	if r.cache == nil {
		return nil
	}
	tasks, err := task.After(ctx, r.pool, r.cacheCursor, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	if len(tasks) < r.cfg.BatchSize {
		r.cacheCursor = ""
	} else {
		r.cacheCursor = tasks[len(tasks)-1].TaskID
	}
	if len(tasks) == 0 {
		return nil
	}
	pipe := r.cfg.Redis.Pipeline()
	cmds := make([]*redis.StringCmd, len(tasks))
	for i, t := range tasks {
		cmds[i] = pipe.HGet(ctx, cacheKey(t.TaskID), "v")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	for i, t := range tasks {
		v, err := cmds[i].Int64()
		if errors.Is(err, redis.Nil) || (err == nil && v == t.Version) {
			continue
		}
		if err != nil {
			r.act(res, ActionError, nil)
			continue
		}
		if v > t.Version {
			// A view ahead of the database (issue 13: a forged or
			// misrouted event). It may also be a real event whose commit
			// this pass cannot see yet, so the view is removed, never
			// rewritten older: readers fall back to PostgreSQL, and a view
			// older than a later database version is repaired as usual.
			gone, err := r.cache.InvalidateVersion(ctx, t.TaskID, v)
			switch {
			case err != nil:
				r.log.WarnContext(ctx, "remove task view ahead of the database", slog.String("task_id", t.TaskID), slog.Any("err", err))
				r.act(res, ActionError, nil)
			case !gone:
				r.act(res, ActionSkipped, nil)
			default:
				r.log.WarnContext(ctx, "task view ahead of the database removed", slog.String("task_id", t.TaskID),
					slog.Int64("view_version", v), slog.Int64("version", t.Version))
				r.act(res, ActionCacheRepaired, &res.CacheRepaired)
			}
			continue
		}
		stored, err := r.cache.Put(ctx, t)
		switch {
		case err != nil:
			r.log.WarnContext(ctx, "repair task view", slog.String("task_id", t.TaskID), slog.Any("err", err))
			r.act(res, ActionError, nil)
		case !stored:
			r.act(res, ActionSkipped, nil)
		default:
			r.log.InfoContext(ctx, "stale task view repaired", slog.String("task_id", t.TaskID), slog.Int64("view_version", v), slog.Int64("version", t.Version))
			r.act(res, ActionCacheRepaired, &res.CacheRepaired)
		}
	}
	return nil
}
