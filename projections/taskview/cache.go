package taskview

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/taskevent"
)

// SchemaVersion is the version of the stored view's serialization; it is
// part of every key, so a new serialization gets a new namespace (seed 9.2).
const SchemaVersion = 1

// KeyPrefix is the prefix of every task view key: "task-view:v1:".
const KeyPrefix = "task-view:v1:"

// maxVersion is 2^53: versions at or above it are not exact as Lua doubles.
const maxVersion = int64(1) << 53

// ErrInvalidTask is returned (wrapped) by Put for a snapshot that can never
// be stored: empty task id, or a version outside [0, 2^53). Retrying does
// not help.
var ErrInvalidTask = errors.New("invalid task snapshot")

// ClientOptions parses a redis:// URL into go-redis options with the
// timeouts converge's readers need (issue 13): context deadlines honoured
// (ContextTimeoutEnabled; go-redis ignores them by default and waits its
// own 3 s read timeout), a 1 s dial timeout and 1 s read and write
// timeouts as the bound for calls without a deadline. An unparsable URL is
// an error.
func ClientOptions(url string) (*redis.Options, error) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("redis url: %w", err)
	}
	opt.ContextTimeoutEnabled = true
	opt.DialTimeout = time.Second
	opt.ReadTimeout = time.Second
	opt.WriteTimeout = time.Second
	return opt, nil
}

// Key returns the Redis key of a task's view: KeyPrefix + taskID.
func Key(taskID string) string { return KeyPrefix + taskID }

// putScript is the compare-and-set of Put. KEYS[1] is the view key, ARGV[1]
// the incoming version (decimal), ARGV[2] the task JSON, ARGV[3] the TTL in
// milliseconds. It stores only when no view exists or the stored version is
// strictly lower, and returns 1 when it stored, 0 otherwise. Versions are
// below 2^53, so Lua's doubles compare them exactly.
var putScript = redis.NewScript(`
local cur = redis.call('HGET', KEYS[1], 'v')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'json', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
`)

// CacheOptions configures a Cache. The zero value is usable.
type CacheOptions struct {
	// TTL is the base time to live of a stored view. Eviction is a normal
	// path (seed 9.3): readers fall back to PostgreSQL. Defaults to 24h.
	TTL time.Duration
	// TTLJitter is the fraction of TTL added at random to each write's TTL
	// (the TTL is uniform in [TTL, TTL*(1+TTLJitter)]), so views written
	// together do not expire together. Must be at most 1. Defaults to 0.1;
	// a negative value disables jitter.
	TTLJitter float64
	// Registerer receives converge_cache_stale_writes_rejected_total. When
	// it already holds that collector (an API and a projector sharing one
	// registry), the existing one is reused. Defaults to a fresh registry
	// (the metric is then not exported).
	Registerer prometheus.Registerer
	// Faults arms fault.CacheWriteError (keys: task id, input SHA-256):
	// Put and Invalidate then fail before reaching Redis. Defaults to nil
	// (off).
	Faults *fault.Set
}

func (o *CacheOptions) setDefaults() {
	if o.TTL == 0 {
		o.TTL = 24 * time.Hour
	}
	if o.TTLJitter == 0 {
		o.TTLJitter = 0.1
	}
	if o.TTLJitter < 0 {
		o.TTLJitter = 0
	}
	if o.Registerer == nil {
		o.Registerer = prometheus.NewRegistry()
	}
}

// Validate reports an unusable option after defaults are applied.
func (o *CacheOptions) Validate() error {
	if o.TTL < time.Millisecond {
		return fmt.Errorf("cache TTL %s: must be at least 1ms", o.TTL)
	}
	if o.TTLJitter > 1 {
		return fmt.Errorf("cache TTLJitter %g: must be at most 1", o.TTLJitter)
	}
	return nil
}

// Cache is the Redis task view: one hash per task under Key(taskID) with
// fields "v" (the task version, decimal) and "json" (the JSON of
// taskevent.Task). It is a derived view (seed 9): it may be stale or absent
// at any time and never decides a write. Safe for concurrent use.
type Cache struct {
	client *redis.Client
	opts   CacheOptions
	stale  prometheus.Counter
}

// NewCache returns a Cache over client. It fails on invalid options or when
// the stale-write counter cannot be registered.
func NewCache(client *redis.Client, opts CacheOptions) (*Cache, error) {
	if client == nil {
		return nil, errors.New("task view cache: nil redis client")
	}
	opts.setDefaults()
	if err := opts.Validate(); err != nil {
		return nil, fmt.Errorf("task view cache: %w", err)
	}
	stale, err := registerOrReuse(opts.Registerer, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "converge_cache_stale_writes_rejected_total",
		Help: "Task view writes rejected by the version compare-and-set because the stored version was equal or newer.",
	}))
	if err != nil {
		return nil, fmt.Errorf("task view cache metrics: %w", err)
	}
	return &Cache{client: client, opts: opts, stale: stale}, nil
}

// Put stores t as the view of t.TaskID if, atomically in one Lua script,
// no view exists or the stored version is strictly lower than t.Version
// (DESIGN "projections": version-guarded writes). It returns stored=false,
// err=nil when a view with an equal or newer version is already stored; the
// TTL is then left unchanged. An invalid snapshot (ErrInvalidTask) or a
// Redis failure is an error.
func (c *Cache) Put(ctx context.Context, t taskevent.Task) (bool, error) {
	rs, err := c.PutMany(ctx, []taskevent.Task{t})
	if err != nil {
		return false, err
	}
	return rs[0].Stored, rs[0].Err
}

// PutResult is PutMany's answer for one snapshot: Put's.
type PutResult struct {
	// Stored is true when the snapshot was stored, false when a view with an
	// equal or newer version was already there (or Err is set).
	Stored bool
	// Err is ErrInvalidTask, or the write's own failure (an injected
	// fault.CacheWriteError); the snapshot was not stored.
	Err error
}

// PutMany is Put for several snapshots in one round trip: a pipeline of
// Put's script, each write atomic and version-guarded on its own (a
// pipeline is not a transaction; none is needed, since each compare-and-set
// decides alone). results[i] answers ts[i]. err is a failure of the
// pipeline (Redis down, a timeout): then the outcome of every valid write is
// unknown, and the caller repeats them, which the version guard makes
// harmless.
func (c *Cache) PutMany(ctx context.Context, ts []taskevent.Task) ([]PutResult, error) {
	rs := make([]PutResult, len(ts))
	raws := make([][]byte, len(ts))
	valid := 0
	for i, t := range ts {
		raw, err := c.encode(t)
		if err == nil {
			err = c.opts.Faults.ErrKey(fault.CacheWriteError, t.TaskID, t.InputSHA256)
			if err != nil {
				err = fmt.Errorf("put task view %s v%d: %w", t.TaskID, t.Version, err)
			}
		}
		if err != nil {
			rs[i].Err = err
			continue
		}
		raws[i] = raw
		valid++
	}
	if valid == 0 {
		return rs, nil
	}
	// EVALSHA first (the script's body is not sent each time); a Redis that
	// forgot the script (restarted, flushed) answers NOSCRIPT, and the
	// writes go again with EVAL, which cannot (it also caches the script).
	for evalBody := false; ; evalBody = true {
		cmds := make([]*redis.Cmd, len(ts))
		_, err := c.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for i, t := range ts {
				if raws[i] == nil {
					continue
				}
				keys, args := []string{Key(t.TaskID)}, []any{t.Version, raws[i], c.ttl().Milliseconds()}
				if evalBody {
					cmds[i] = putScript.Eval(ctx, pipe, keys, args...)
				} else {
					cmds[i] = putScript.EvalSha(ctx, pipe, keys, args...)
				}
			}
			return nil
		})
		if err != nil && !evalBody && redis.HasErrorPrefix(err, "NOSCRIPT") {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("put %d task views: %w", valid, err)
		}
		for i, cmd := range cmds {
			if cmd == nil {
				continue
			}
			if n, _ := cmd.Int(); n == 1 {
				rs[i].Stored = true
			} else {
				c.stale.Inc()
			}
		}
		return rs, nil
	}
}

// encode checks t and renders the JSON a view stores.
func (c *Cache) encode(t taskevent.Task) ([]byte, error) {
	if t.TaskID == "" {
		return nil, fmt.Errorf("%w: empty task id", ErrInvalidTask)
	}
	if t.Version < 0 || t.Version >= maxVersion {
		return nil, fmt.Errorf("%w: version %d outside [0, 2^53)", ErrInvalidTask, t.Version)
	}
	// The RFC 8785 form, written directly (taskevent.AppendTask: half of
	// json.Marshal's time and one allocation instead of five,
	// BenchmarkTaskView); encoding/json for the values it leaves (invalid
	// UTF-8, out-of-range integers or times). Get decodes either.
	if raw, ok := taskevent.AppendTask(make([]byte, 0, 512), &t); ok {
		return raw, nil
	}
	raw, err := json.Marshal(t)
	if err != nil {
		return nil, fmt.Errorf("%w: encode task %s: %v", ErrInvalidTask, t.TaskID, err)
	}
	return raw, nil
}

func (c *Cache) ttl() time.Duration {
	if c.opts.TTLJitter == 0 {
		return c.opts.TTL
	}
	return c.opts.TTL + time.Duration(rand.Float64()*c.opts.TTLJitter*float64(c.opts.TTL))
}

// Get returns the stored view of taskID and true, or nil and false when no
// view is stored (never written, expired or evicted). A Redis failure or a
// stored value that does not decode is an error; callers fall back to
// PostgreSQL.
func (c *Cache) Get(ctx context.Context, taskID string) (*taskevent.Task, bool, error) {
	raw, err := c.client.HGet(ctx, Key(taskID), "json").Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("get task view %s: %w", taskID, err)
	}
	var t taskevent.Task
	if err := json.Unmarshal(raw, &t); err != nil {
		return nil, false, fmt.Errorf("decode task view %s: %w", taskID, err)
	}
	return &t, true, nil
}

// Invalidate deletes the view of taskID (DEL). Writers that change a task
// outside the event stream call it after their PostgreSQL commit (seed 9:
// commit first, then invalidate); the next read back-fills from PostgreSQL.
func (c *Cache) Invalidate(ctx context.Context, taskID string) error {
	if err := c.opts.Faults.ErrKey(fault.CacheWriteError, taskID); err != nil {
		return fmt.Errorf("invalidate task view %s: %w", taskID, err)
	}
	if err := c.client.Del(ctx, Key(taskID)).Err(); err != nil {
		return fmt.Errorf("invalidate task view %s: %w", taskID, err)
	}
	return nil
}

// invalidateVersionScript deletes KEYS[1] only while its stored version
// is ARGV[1]; 1 when it deleted.
var invalidateVersionScript = redis.NewScript(`
local cur = redis.call('HGET', KEYS[1], 'v')
if cur and tonumber(cur) == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
`)

// InvalidateVersion deletes the view of taskID only while its stored
// version is version (a compare-and-delete, one Lua script), and reports
// whether it did: the reconciler removes a view ahead of PostgreSQL this
// way without removing a newer write that raced it.
func (c *Cache) InvalidateVersion(ctx context.Context, taskID string, version int64) (bool, error) {
	if err := c.opts.Faults.ErrKey(fault.CacheWriteError, taskID); err != nil {
		return false, fmt.Errorf("invalidate task view %s: %w", taskID, err)
	}
	n, err := invalidateVersionScript.Run(ctx, c.client, []string{Key(taskID)}, version).Int()
	if err != nil {
		return false, fmt.Errorf("invalidate task view %s at version %d: %w", taskID, version, err)
	}
	return n == 1, nil
}

// registerOrReuse registers c on reg; when an equal collector is already
// registered it returns that one, so components sharing a registry share
// the metric.
func registerOrReuse[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing, nil
			}
		}
		return c, err
	}
	return c, nil
}
