package devbroker

import (
	"context"
	"encoding/binary"
	"log/slog"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// header is the start of a request frame: size, api key 18, version 3,
// correlation id 7, client id (n < 0: null).
func header(id string, n int16) []byte {
	b := make([]byte, 14, 14+len(id))
	binary.BigEndian.PutUint32(b[0:4], uint32(10+len(id)+20)) // plus a body
	binary.BigEndian.PutUint16(b[4:6], 18)
	binary.BigEndian.PutUint16(b[6:8], 3)
	binary.BigEndian.PutUint32(b[8:12], 7)
	binary.BigEndian.PutUint16(b[12:14], uint16(n))
	return append(b, id...)
}

func TestParseClientID(t *testing.T) {
	t.Parallel()
	full := header("converge-worker-h-42", 20)
	tooShortFrame := header("abc", 3)
	binary.BigEndian.PutUint32(tooShortFrame[0:4], 11) // declares fewer bytes than the id needs
	tests := []struct {
		name     string
		in       []byte
		id       string
		ok, done bool
	}{
		{"whole header", append(full, 1, 2, 3), "converge-worker-h-42", true, true},
		{"exact header", full, "converge-worker-h-42", true, true},
		{"size only", full[:4], "", false, false},
		{"half the id", full[:20], "", false, false},
		{"null id", header("", -1), "", true, true},
		{"empty id", header("", 0), "", true, true},
		{"id beyond the frame", tooShortFrame, "", false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, ok, done := parseClientID(tt.in)
			if id != tt.id || ok != tt.ok || done != tt.done {
				t.Errorf("parseClientID = %q, %v, %v; want %q, %v, %v", id, ok, done, tt.id, tt.ok, tt.done)
			}
		})
	}
}

// TestConnsFollowClientLifetime checks that the tracked connections carry
// the client's id while it is open and are gone once it closed.
func TestConnsFollowClientLifetime(t *testing.T) {
	t.Parallel()
	b, err := Start(Config{Opts: []kfake.Opt{kfake.NumBrokers(1)}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.ListenAddrs()...), kgo.ClientID("converge-test-client"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !b.conns.alive("", "converge-test-client") {
		t.Fatal("no open connection carries the client's id after a request")
	}
	// The reaper connects at its first scan, which runs concurrently with
	// the Ping above: wait for it rather than assume it came first.
	deadline := time.Now().Add(5 * time.Second)
	for !b.conns.alive("", ClientID) {
		if time.Now().After(deadline) {
			t.Fatal("the reaper's own connection is not tracked 5s after Start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cl.Close()
	deadline = time.Now().Add(5 * time.Second)
	for b.conns.alive("", "converge-test-client") {
		if time.Now().After(deadline) {
			t.Fatal("the closed client's connections are still tracked as open after 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, c := range []Config{{ScanInterval: -time.Second}, {Confirmations: -1}, {RestoredGrace: -time.Second}} {
		c.setDefaults()
		if err := c.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil, want an error", c)
		}
	}
	var c Config
	c.setDefaults()
	if err := c.Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
	if c.ScanInterval != time.Second || c.Confirmations != 2 || c.RestoredGrace != 15*time.Second {
		t.Errorf("defaults = %+v", c)
	}
}
