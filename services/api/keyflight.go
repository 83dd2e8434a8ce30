package api

import "sync"

// keyFlights lets one create request per idempotency key wait on the
// database at a time in this process (D1 of the 2026-12-04 review). Without
// it, every request for a key whose record another transaction holds
// uncommitted (a stuck client transaction, a create still running) takes a
// pool connection and waits there for the lock timeout: thirty such
// requests on a four-connection pool starve every other request for
// seconds. With it, the first request for a key (the leader) runs as
// before; the others (followers) wait without a connection until the
// leader ends and then:
//   - when the leader found the key held (409 IDEMPOTENCY_REQUEST_IN_PROGRESS),
//     answer the same at once: the key is still held;
//   - otherwise run their own create, which finds the key recorded (the
//     leader's task, or the record that beat it) and answers from it.
//
// The database still decides between concurrent first uses (the record's
// primary key); keyFlights only keeps waiters off the pool, per process.
type keyFlights struct {
	mu sync.Mutex
	m  map[flightKey]*flight
}

type flightKey struct{ scope, key string }

// flight is one leader's create: done is closed when it ends; held tells
// whether it ended because another transaction held the key.
type flight struct {
	done chan struct{}
	held bool
}

// begin returns the flight of (scope, key) and whether the caller leads it.
// A leader must call end exactly once.
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

// end ends the leader's flight of (scope, key), releasing its followers.
func (f *keyFlights) end(scope, key string, fl *flight, held bool) {
	f.mu.Lock()
	delete(f.m, flightKey{scope, key})
	f.mu.Unlock()
	fl.held = held
	close(fl.done)
}
