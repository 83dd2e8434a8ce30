// Package freeport picks TCP ports for servers that converge's tools start
// as separate processes (the embedded PostgreSQL, Redis and broker of a
// bench side, an experiment's stack, a test's cluster).
package freeport

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// Pick returns a TCP port on 127.0.0.1 that was free a moment ago. It
// prefers a port below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range, read from /proc): between Pick and the
// server's bind, any outgoing connection on the machine may be given a port
// of that range, and a port from it (what port 0 gives) was seen taken so,
// failing a bench side's Redis with EADDRINUSE. When the range cannot be
// read, or starts below 20000, it falls back to a port the kernel chooses.
//
// A port is not returned twice by one process: a caller that picks several
// before starting its servers (a bench side's PostgreSQL, broker and Redis)
// gets distinct ones. The error is the listen's, or says that 50 ports the
// kernel chose had all been returned before.
func Pick() (int, error) {
	mu.Lock()
	defer mu.Unlock()
	if low, ok := ephemeralLow(); ok && low > 20000 {
		for range 50 {
			p := 10000 + rand.IntN(low-10000)
			if picked[p] {
				continue
			}
			if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p)); err == nil {
				l.Close()
				picked[p] = true
				return p, nil
			}
		}
	}
	for range 50 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		p := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if !picked[p] {
			picked[p] = true
			return p, nil
		}
	}
	return 0, errors.New("freeport: no free port not picked before in 50 tries")
}

var (
	mu     sync.Mutex
	picked = map[int]bool{} // the ports Pick returned in this process
)

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
