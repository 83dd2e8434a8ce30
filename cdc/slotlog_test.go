package cdc

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// logBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// TestCreatedSlotWarnsAfterEarlierOutboxRows: a slot the relay creates on a
// database whose outbox already holds rows is a warning, since the rows
// committed before it are not streamed (the reconciler republishes them); on
// a fresh outbox its creation is logged at INFO.
func TestCreatedSlotWarnsAfterEarlierOutboxRows(t *testing.T) {
	t.Parallel()
	for _, earlier := range []bool{false, true} {
		b := setup(t)
		if earlier {
			b.insertTx(t, b.event(t, "task-before-slot", 1))
		}
		var logs logBuffer
		cfg := b.config()
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
		rr := b.startStreaming(t, cfg)
		if err := rr.stop(t); err != nil {
			t.Fatal(err)
		}
		var created string
		for line := range strings.Lines(logs.String()) {
			if strings.Contains(line, "created replication slot") {
				created = line
			}
		}
		wantLevel := "level=INFO"
		if earlier {
			wantLevel = "level=WARN"
		}
		if !strings.Contains(created, wantLevel) || (earlier && !strings.Contains(created, "republishes those not recorded published")) {
			t.Errorf("earlier outbox rows %v: slot creation logged as %q, want %s", earlier, created, wantLevel)
		}
	}
}
