package api

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/converge-run/converge/internal/dbpool"
	"github.com/converge-run/converge/internal/ledger"
	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/task"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/internal/tenant"
	"github.com/converge-run/converge/services/api/idempotency"
)

var (
	// errKeyTaken: the idempotency record's primary key already exists; the
	// create transaction was rolled back.
	errKeyTaken = errors.New("idempotency key already recorded")
	// errTaskNotFound: no task row has this id.
	errTaskNotFound = errors.New("task not found")
)

// errKeyHeldDetail is the detail of 409 IDEMPOTENCY_REQUEST_IN_PROGRESS for
// a key whose record another transaction holds.
const errKeyHeldDetail = "a request with this idempotency key is being processed; retry after it ends"

// store runs the API's transactions on the aggregates' owners (packages
// idempotency, task, outbox, ledger).
type store struct {
	pool     *pgxpool.Pool
	coalesce *coalescer // nil: every create in its own transaction
}

// createTask runs the create transaction of seed section 3.1 for one
// request: in a group transaction with the concurrent ones when the store
// coalesces creates (coalesce.go), else alone (createOne). The outcomes are
// those of createOne.
func (s *store) createTask(ctx context.Context, k idempotency.Key, p tenant.Principal, d *taskDraft) (*newTask, error) {
	if s.coalesce == nil {
		return s.createOne(ctx, k, p, d, maxAloneLockTimeout)
	}
	return s.coalesce.do(&createReq{ctx: ctx, k: k, p: p, draft: d, done: make(chan createResult, 1)})
}

// newTask is everything the create transaction writes besides the
// idempotency record.
type newTask struct {
	Task          taskevent.Task // the snapshot at version 0
	Document      []byte         // the "document" member's RFC 8785 form (canon.Transform), as task.CanonicalInput expects
	OutboxID      string
	Payload       []byte // canonical JSON of the TaskCreated event
	PayloadSHA256 string
	Response      []byte // canonical JSON of the 202 body
}

// createOne runs the create transaction of seed section 3.1 for one
// request. The idempotency record is inserted FIRST, complete (succeeded,
// with the draft's task id and 202 body; migration 00016), with ON CONFLICT
// DO NOTHING: its primary key decides between concurrent first uses (a
// concurrent inserter waits for the winner's commit or rollback). Only the
// winner goes on: the draft builds the task, its input and the TaskCreated
// outbox row with the transaction's timestamp (the database clock, now()),
// and they are inserted in the same transaction; the record's foreign key
// to the task is checked at COMMIT. A loser gets errKeyTaken with nothing
// written; it then reads the record.
//
// The transaction takes two round trips to PostgreSQL
// (dbpool.InPipelinedTx): BEGIN, the transaction's lock_timeout
// (aloneLockTimeout) and the record insert, whose RETURNING gives the
// timestamp; then the task and task_input inserts (package task), the
// outbox insert (package outbox) and COMMIT. A statement that fails makes
// PostgreSQL skip the rest of its batch, COMMIT included; the transaction is
// then rolled back.
func (s *store) createOne(ctx context.Context, k idempotency.Key, p tenant.Principal, d *taskDraft, maxWait time.Duration) (*newTask, error) {
	var n *newTask
	err := dbpool.InPipelinedTx(ctx, s.pool, func(tx *dbpool.PipelinedTx) error {
		var b pgx.Batch
		var now time.Time
		queueLockTimeout(&b, aloneLockTimeout(ctx, maxWait))
		idempotency.QueueInsertSucceeded(&b, k, d.TaskID, d.Response, &now)
		err := tx.SendBatch(ctx, &b)
		if errors.Is(err, pgx.ErrNoRows) {
			return errKeyTaken
		}
		if lockNotAvailable(err) {
			// Another transaction holds this key's record uncommitted: a
			// concurrent request with the same key (seed 3.1), still running.
			return &Error{Code: CodeIdempotencyInProgress, Detail: errKeyHeldDetail, Err: err}
		}
		if err != nil {
			return fmt.Errorf("insert idempotency record: %w", err)
		}

		if n, err = d.build(now.UTC()); err != nil {
			return err
		}
		b = pgx.Batch{}
		queueCreateRows(&b, k, p, n, nil)
		if err := tx.SendBatchAndCommit(ctx, &b); errors.Is(err, tenant.ErrQuotaExhausted) {
			return err
		} else if err != nil {
			return fmt.Errorf("create task %s: %w", n.Task.TaskID, err)
		}
		return nil
	})
	var unknown *dbpool.CommitUnknownError
	if errors.As(err, &unknown) && n != nil && s.recordNames([]context.Context{ctx}, k, n.Task.TaskID) {
		return n, nil // committed although its answer was lost
	}
	if err != nil {
		return nil, err
	}
	return n, nil
}

const (
	// settleGrace is how long past its request's deadline the read that
	// settles a lost COMMIT answer may take: the deadline is often what lost
	// the answer (pgx closes a connection whose context ends mid-batch).
	settleGrace = time.Second
	// settleTimeout caps the settle read, also for a request without a
	// deadline.
	settleTimeout = 5 * time.Second
)

// settleContext returns the context of the read that settles the lost
// COMMIT answer of the requests whose contexts are reqs (one request, or a
// group's members). It ends at the earliest of their deadlines, or
// settleGrace from now if that is later, and at most settleTimeout from
// now; and at once when every one of reqs was cancelled (ctx.Err() is
// context.Canceled, not DeadlineExceeded: the client left, so nobody reads
// the answer). When the request's deadline is what lost the answer, the
// settle starts at that deadline, so the handler, its tenant's in-flight
// slot and its key's flight are held at most settleGrace past it, and not
// at all for a client that is gone (the eighth session's review: up to 5 s
// past the deadline, also when the client had left).
func settleContext(reqs ...context.Context) (context.Context, context.CancelFunc) {
	now := time.Now()
	end := now.Add(settleTimeout)
	for _, r := range reqs {
		if d, ok := r.Deadline(); ok && d.Before(end) {
			end = d
		}
	}
	if grace := now.Add(settleGrace); end.Before(grace) {
		end = grace
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	var present atomic.Int64
	present.Store(int64(len(reqs)))
	stops := make([]func() bool, len(reqs))
	for i, r := range reqs {
		stops[i] = context.AfterFunc(r, func() {
			if errors.Is(r.Err(), context.Canceled) && present.Add(-1) == 0 {
				cancel()
			}
		})
	}
	return ctx, func() {
		for _, stop := range stops {
			stop()
		}
		cancel()
	}
}

// recordNames settles a create transaction whose COMMIT was sent but whose
// answer was lost (a broken connection, the request's deadline): it reads,
// on a connection of the pool, the idempotency record of key k; the
// transaction committed exactly when that record names taskID (all of a
// transaction or nothing). The read is bounded by settleContext(reqs...).
// Not named (no record, or one naming another request's task) and not
// known (the read failed or ran out of time, or the transaction is still
// running and not yet visible) are false: the request then fails as
// before, and its retry with the same key answers from the record.
func (s *store) recordNames(reqs []context.Context, k idempotency.Key, taskID string) bool {
	ctx, cancel := settleContext(reqs...)
	defer cancel()
	rec, err := s.idempotencyRecord(ctx, k.Scope, k.Key)
	return err == nil && rec.TaskID != nil && *rec.TaskID == taskID
}

const (
	// maxAloneLockTimeout is the longest a create transaction of one request
	// waits for a lock (lock_timeout): for its key's record, held by a
	// concurrent request with the same key whose transaction has not ended,
	// or for its tenant's quota row. Past it the request is 409
	// IDEMPOTENCY_REQUEST_IN_PROGRESS (the record) or 503
	// DATABASE_UNAVAILABLE (anything else), both with Retry-After: requests
	// for a key held by a stuck transaction do not hold pool connections
	// until their deadlines and starve requests for other keys.
	maxAloneLockTimeout = time.Second
	// afterGroupLockTimeout is the lock_timeout of a request running alone
	// after its group transaction failed: it has waited groupLockTimeout
	// already, and a lock held longer than that belongs to a transaction
	// that is not ending soon (a create of the same key commits in
	// milliseconds). Short, so that the members of groups failed on many
	// held keys do not hold the pool's connections one second each (the
	// second fresh-clone review of 2026-12-04).
	afterGroupLockTimeout = 100 * time.Millisecond
	// minLockTimeout is the least lock_timeout set (0 would mean none).
	minLockTimeout = 10 * time.Millisecond
)

// sqlSetLockTimeout sets lock_timeout ($1, milliseconds as text) for the
// rest of the transaction; one statement text for every value, so pgx
// prepares it once.
const sqlSetLockTimeout = `SELECT set_config('lock_timeout', $1, true)`

// queueLockTimeout queues on b the lock_timeout d (whole milliseconds) for
// the rest of the transaction: the group transaction's and the
// single-request one's.
func queueLockTimeout(b *pgx.Batch, d time.Duration) {
	b.Queue(sqlSetLockTimeout, strconv.FormatInt(d.Milliseconds(), 10))
}

// aloneLockTimeout is the lock_timeout of a single-request create
// transaction under ctx: maxWait, or half the time ctx has
// left when that is shorter, so that a lock wait ends as a lock timeout
// (409 in progress), not as the request's deadline (503).
func aloneLockTimeout(ctx context.Context, maxWait time.Duration) time.Duration {
	lt := maxWait
	if d, ok := ctx.Deadline(); ok {
		lt = min(lt, time.Until(d)/2)
	}
	return max(lt, minLockTimeout)
}

// lockNotAvailable reports whether err is PostgreSQL's lock_timeout
// (SQLSTATE 55P03 lock_not_available).
func lockNotAvailable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// queueCreateRows queues on b what the create transaction writes for one
// request after its record was inserted: the quota consumption (first: no
// lock held long, nothing inserted when exhausted), the task and its input
// and the TaskCreated outbox row. With events not
// nil the outbox row is appended to *events instead, for the caller to
// insert with the others of its transaction (outbox.QueueInsertMany).
func queueCreateRows(b *pgx.Batch, k idempotency.Key, p tenant.Principal, n *newTask, events *[]outbox.Row) {
	if p.HasQuota {
		tenant.QueueConsumeQuota(b, p.TenantID)
	}
	t := n.Task
	task.QueueCreate(b, t, k.Fingerprint, n.Document)
	row := outbox.Row{ID: n.OutboxID, TaskID: t.TaskID, Version: t.Version, Type: taskevent.TypeTaskCreated,
		Payload: n.Payload, PayloadSHA256: n.PayloadSHA256, CreatedAt: t.CreatedAt, TenantID: t.TenantID}
	if events != nil {
		*events = append(*events, row)
	} else {
		outbox.QueueInsert(b, row)
	}
}

// idempotencyRecord reads the create record of key, or returns an error
// wrapping pgx.ErrNoRows.
func (s *store) idempotencyRecord(ctx context.Context, scope, key string) (*idempotency.Record, error) {
	return idempotency.Get(ctx, s.pool, scope, key)
}

// task reads a task row as a snapshot, or returns errTaskNotFound.
func (s *store) task(ctx context.Context, id string) (*taskevent.Task, error) {
	t, found, err := task.Get(ctx, s.pool, id)
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, errTaskNotFound
	}
	return &t, nil
}

// verifiedArtifactToken returns the store token of the task's verified
// artifact, or an error wrapping ledger.ErrNoVerifiedArtifact.
func (s *store) verifiedArtifactToken(ctx context.Context, taskID string) (string, error) {
	return ledger.VerifiedArtifactToken(ctx, s.pool, taskID)
}

// artifactDeleted reports whether the artifact of put token token has a
// deletion recorded (retention, ledger.ArtifactDeleted).
func (s *store) artifactDeleted(ctx context.Context, token string) (bool, error) {
	return ledger.ArtifactDeleted(ctx, s.pool, token)
}

// ping checks that PostgreSQL answers.
func (s *store) ping(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("ping database: %w", err)
	}
	return nil
}
