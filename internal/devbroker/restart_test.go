package devbroker_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/devbroker"
	"github.com/converge-run/converge/internal/testenv"
)

// TestStopRestartKeepsState stops the broker under clients that stay open
// and restarts it: while stopped its address refuses connections; after
// Restart it listens on the same address with its records and committed
// offsets reloaded from DataDir, and a record the (idempotent) producer
// was given during the outage is delivered once, after the earlier ones.
func TestStopRestartKeepsState(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	const topic, group = "restart", "restart-group"
	// A port below the ephemeral range: the restart binds it again.
	b, err := devbroker.Start(devbroker.Config{DataDir: t.TempDir(), Logger: slog.New(slog.DiscardHandler),
		Opts: []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(testenv.FreePort(t)), kfake.SeedTopics(1, topic)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	addrs := b.ListenAddrs()
	prod, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(prod.Close)
	for i := range 10 {
		if err := prod.ProduceSync(ctx, kgo.StringRecord("before-"+strconv.Itoa(i))).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic), kgo.ConsumerGroup(group),
		kgo.ClientID("restart-test-consumer"), kgo.DisableAutoCommit(), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cons.Close)
	var got []string
	for len(got) < 10 {
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		fs := cons.PollFetches(pctx)
		timedOut := pctx.Err() != nil
		cancel()
		if timedOut {
			t.Fatalf("consumed %d of 10 records within 10s", len(got))
		}
		fs.EachRecord(func(r *kgo.Record) { got = append(got, string(r.Value)) })
		if err := cons.CommitUncommittedOffsets(ctx); err != nil {
			t.Fatal(err)
		}
	}

	if err := b.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := b.Stop(); err != nil {
		t.Errorf("second Stop = %v, want nil (no-op)", err)
	}
	if b.Cluster() != nil {
		t.Error("Cluster() of a stopped broker is not nil")
	}
	if c, err := net.DialTimeout("tcp", addrs[0], time.Second); err == nil {
		c.Close()
		t.Fatalf("the stopped broker's address %s accepts connections", addrs[0])
	}
	delivered := make(chan error, 1)
	prod.Produce(ctx, kgo.StringRecord("during"), func(_ *kgo.Record, err error) { delivered <- err })
	time.Sleep(500 * time.Millisecond) // the record waits in the producer while the broker is away
	select {
	case err := <-delivered:
		t.Fatalf("record produced while the broker is stopped finished before Restart: %v", err)
	default:
	}

	if err := b.Restart(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b.ListenAddrs(), addrs) {
		t.Errorf("ListenAddrs after Restart = %v, want %v", b.ListenAddrs(), addrs)
	}
	if err := b.Restart(); !errors.Is(err, devbroker.ErrRunning) {
		t.Errorf("Restart of a running broker = %v, want ErrRunning", err)
	}
	select {
	case err := <-delivered:
		if err != nil {
			t.Fatalf("record produced during the outage: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("record produced during the outage not delivered within 30s of Restart")
	}

	adm := kadm.NewClient(prod)
	offs, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := offs.Lookup(topic, 0); !ok || o.At != 10 {
		t.Errorf("committed offset of %s after Restart = %+v (found %v), want 10", group, o, ok)
	}
	all, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(all.Close)
	var log []string
	for len(log) < 11 {
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		fs := all.PollFetches(pctx)
		timedOut := pctx.Err() != nil
		cancel()
		if timedOut {
			break
		}
		fs.EachRecord(func(r *kgo.Record) { log = append(log, strconv.FormatInt(r.Offset, 10)+":"+string(r.Value)) })
	}
	want := []string{}
	for i := range 10 {
		want = append(want, strconv.Itoa(i)+":before-"+strconv.Itoa(i))
	}
	want = append(want, "10:during")
	if !slices.Equal(log, want) {
		t.Errorf("log after Restart = %v, want %v", log, want)
	}
}

// TestStopRestartErrors checks the refusals: no DataDir, after Close.
func TestStopRestartErrors(t *testing.T) {
	t.Parallel()
	mem, err := devbroker.Start(devbroker.Config{Logger: slog.New(slog.DiscardHandler), Opts: []kfake.Opt{kfake.NumBrokers(1)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(mem.Close)
	if err := mem.Stop(); !errors.Is(err, devbroker.ErrNoDataDir) {
		t.Errorf("Stop without DataDir = %v, want ErrNoDataDir", err)
	}
	if mem.Cluster() == nil {
		t.Error("a refused Stop stopped the cluster")
	}
	b, err := devbroker.Start(devbroker.Config{DataDir: t.TempDir(), Logger: slog.New(slog.DiscardHandler), Opts: []kfake.Opt{kfake.NumBrokers(1)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Stop(); err != nil {
		t.Fatal(err)
	}
	b.Close() // on a stopped broker
	b.Close()
	if err := b.Restart(); !errors.Is(err, devbroker.ErrClosed) {
		t.Errorf("Restart after Close = %v, want ErrClosed", err)
	}
	if err := b.Stop(); !errors.Is(err, devbroker.ErrClosed) {
		t.Errorf("Stop after Close = %v, want ErrClosed", err)
	}
}
