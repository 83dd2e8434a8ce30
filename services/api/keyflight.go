package api

import "sync"

// keyFlights lets one create request per idempotency key wait on the
// database at a time in this process. Without it, every request for a key
// whose record another transaction holds uncommitted (a stuck client
// transaction, a create still running) takes a pool connection and waits
// there for the lock timeout: thirty such requests on a four-connection
// pool starve every other request for seconds (the fresh-clone review of
// 2026-12-04). With it, the first request for a key (the leader) runs as
// before; the others (followers) wait without a connection until the
// leader ends and then:
//   - flightHeld (the leader found the key held: 409
//     IDEMPOTENCY_REQUEST_IN_PROGRESS): answer the same at once;
//   - flightSettled (the leader created the task, or answered from the
//     key's record): run their own create, which finds the record without
//     waiting and answers from it;
//   - flightFailed (the leader failed for a reason of the database: a lock
//     timeout on its tenant's quota row, PostgreSQL unreachable): answer
//     the same error at once, instead of each waiting again in turn;
//   - flightOpen (the leader ended by its own deadline or its client
//     leaving): the next one leads, the others follow it.
//
// The database still decides between concurrent first uses (the record's
// primary key); keyFlights only keeps waiters off the pool, per process.
type keyFlights struct {
	mu sync.Mutex
	m  map[flightKey]*flight
}

type flightKey struct{ scope, key string }

// flightOutcome is how a leader's create ended, for its followers.
type flightOutcome int

const (
	flightOpen    flightOutcome = iota // no outcome: the next request leads
	flightSettled                      // the key is recorded
	flightHeld                         // another transaction held the key
	flightFailed                       // the leader's error (flight.err) is the followers' answer
)

// flight is one leader's create: done is closed when it ends, outcome set
// before.
type flight struct {
	done    chan struct{}
	outcome flightOutcome
	err     error // flightFailed: the leader's error
}

// begin returns the flight of (scope, key) and whether the caller leads it.
// Every leader calls end when its create ends, one time.
func (f *keyFlights) begin(scope, key string) (*flight, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := flightKey{scope, key}
	if fl, ok := f.m[k]; ok {
		return fl, false
	}
	if f.m == nil {
		f.m = map[flightKey]*flight{}
	}
	fl := &flight{done: make(chan struct{})}
	f.m[k] = fl
	return fl, true
}

// end ends the leader's flight of (scope, key) with outcome, releasing its
// followers.
func (f *keyFlights) end(scope, key string, fl *flight, outcome flightOutcome) {
	f.mu.Lock()
	delete(f.m, flightKey{scope, key})
	f.mu.Unlock()
	fl.outcome = outcome
	close(fl.done)
}
