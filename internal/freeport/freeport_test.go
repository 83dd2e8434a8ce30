package freeport

import (
	"net"
	"strconv"
	"testing"
)

func TestPickIsBelowTheEphemeralRangeFreeAndNew(t *testing.T) {
	low, ok := ephemeralLow()
	seen := map[int]bool{}
	for range 200 {
		p, err := Pick()
		if err != nil {
			t.Fatal(err)
		}
		if ok && low > 20000 && (p < 10000 || p >= low) {
			t.Fatalf("Pick() = %d, want 10000 <= port < %d (the ephemeral range's start)", p, low)
		}
		if seen[p] {
			t.Fatalf("Pick() returned %d twice", p)
		}
		seen[p] = true
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatalf("port %d from Pick cannot be bound: %v", p, err)
		}
		l.Close()
	}
}
