package main

import (
	"runtime/debug"
	"testing"

	"github.com/converge-run/converge/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// TestGCPercentDefault: without GOGC the process runs the collector at
// defaultGCPercent; with GOGC set it leaves the runtime's value alone.
func TestGCPercentDefault(t *testing.T) {
	prev := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(prev) })

	setGCPercent(func(string) string { return "" })
	if got := debug.SetGCPercent(100); got != defaultGCPercent {
		t.Fatalf("GOGC unset: GC percent %d, want %d", got, defaultGCPercent)
	}
	setGCPercent(func(k string) string {
		if k == "GOGC" {
			return "100"
		}
		return ""
	})
	if got := debug.SetGCPercent(100); got != 100 {
		t.Fatalf("GOGC=100: GC percent %d, want the runtime's 100 left alone", got)
	}
}
