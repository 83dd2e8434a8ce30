// Package clientid names converge's Kafka clients after the process that
// runs them.
//
// A Kafka client id is sent in the header of every request; brokers show it
// as the ClientID of a consumer-group member (DescribeGroups) and use it in
// logs and quotas. franz-go's default is "kgo" for every client, so a broker
// cannot tell two processes apart by it. converge's consumer-group clients
// (worker, projector, the reconciler's dead-letter intake) use Process
// instead: the embedded development broker (internal/devbroker) evicts a
// member only when no open connection carries its client id any more, which
// is precise only when the id names one process.
//
// Trade-off: a broker-side quota keyed on an exact client id no longer
// matches these clients (quotas keyed on the user principal, or Kafka's
// default client-id quota, still do).
package clientid

import (
	"os"
	"strconv"
	"strings"
)

// Process returns the client id of component in this process:
// "<component>-<hostname>-<pid>", for example
// "converge-worker-build7-4242". Characters of the host name outside
// [A-Za-z0-9._-] become '_'; the host name is "unknown" when it cannot be
// read.
func Process(component string) string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return component + "-" + sanitize(host) + "-" + strconv.Itoa(os.Getpid())
}

func sanitize(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == '-':
			return r
		}
		return '_'
	}, s)
}
