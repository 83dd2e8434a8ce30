// Package freeport picks TCP ports for servers that converge's tools start
// as separate processes (the embedded PostgreSQL, Redis and broker of a
// bench side, an experiment's stack, a test's cluster).
package freeport

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// Pick returns a TCP port on 127.0.0.1 that was free a moment ago. It
// prefers a port below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range, read from /proc): between Pick and the
// server's bind, any outgoing connection on the machine may be given a port
// of that range, and a port from it (what port 0 gives) was seen taken so,
// failing a bench side's Redis with EADDRINUSE. When the range cannot be
// read, or starts below 20000, it falls back to a port the kernel chooses.
// The error is the listen's.
func Pick() (int, error) {
	if low, ok := ephemeralLow(); ok && low > 20000 {
		for range 50 {
			p := 10000 + rand.IntN(low-10000)
			if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p)); err == nil {
				l.Close()
				return p, nil
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ephemeralLow is the first port of the kernel's ephemeral range, where
// /proc says.
func ephemeralLow() (int, bool) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0, false
	}
	low, err := strconv.Atoi(f[0])
	return low, err == nil
}
