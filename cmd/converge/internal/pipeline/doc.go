// Package pipeline assembles converge's components — API, CDC relay,
// worker, projector and reconciler — into one process against given
// PostgreSQL, Kafka and Redis endpoints. `converge dev` (make run) and the
// end-to-end tests use it; production runs each component as its own
// `converge <component>` process instead.
//
// # Supervision (issue 13)
//
// A component that fails (or returns before the process is asked to stop)
// is restarted after 0.5 s doubling to 30 s, with jitter, while the others
// keep running; the API keeps serving (503 DATABASE_UNAVAILABLE while
// PostgreSQL is down). Only a fatal error stops the process with its
// message: the relay's (a lost or mismatched slot; it restarts its own
// sessions otherwise, and waits for a publication that does not deliver
// outbox inserts to be fixed without stopping: with RepairPublication, as
// `converge dev` sets it, it repairs the publication when it opens its next
// session), an injected crash (fault.ErrInjected), the API's listener.
//
// # Metrics
//
//	converge_component_restarts_total{component}   counter   restarts of a failed component: relay, worker, projector, reconciler, lag_sampler
package pipeline
