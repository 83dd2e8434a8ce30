package devbroker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// ClientID is the Kafka client id of the reaper's own client.
const ClientID = "converge-devbroker"

// Config configures Start. Zero values take the defaults noted.
type Config struct {
	// Opts are the kfake options of the cluster (NumBrokers, Ports,
	// SyncWrites, ClusterID, DefaultNumPartitions, ...), passed unchanged.
	// Start appends kfake.ListenFn to track connections, which overrides a
	// ListenFn given here, and kfake.DataDir(DataDir) when DataDir is set;
	// Restart also appends kfake.Ports with the ports of the first start.
	// Defaults to none (kfake's defaults: three brokers on random ports).
	Opts []kfake.Opt
	// DataDir is the cluster's data directory (kfake.DataDir): its state
	// is written there and reloaded at Start and Restart, so topics,
	// records and committed offsets survive both. Stop and Restart need it
	// (ErrNoDataDir). Defaults to none: the state lives in memory and ends
	// with Close.
	DataDir string
	// ScanInterval is the time between two scans of the classic consumer
	// groups (ListGroups + DescribeGroups). Shorter finds dead members
	// sooner, at one DescribeGroups per interval on the broker. Defaults
	// to 1s.
	ScanInterval time.Duration
	// Confirmations is how many scans in a row must find a member's
	// process gone before the member is evicted: 1 evicts at the first
	// sight (a client between two connections could be hit), more waits
	// longer. A member is evicted between (Confirmations-1) and
	// Confirmations ScanIntervals after its process died. Defaults to 2.
	Confirmations int
	// RestoredGrace protects the members found by the first scan, which
	// were restored from DataDir's session state (kfake keeps members
	// across a clean restart) and whose processes may still be
	// reconnecting: they are not evicted before RestoredGrace has passed
	// since Start. Their session timeout removes them anyway if they do not
	// come back. Defaults to 15s.
	RestoredGrace time.Duration
	// Logger receives one line per eviction and scan failures. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Registerer receives the converge_devbroker_* metrics (see the package
	// doc). Defaults to a new, private registry.
	Registerer prometheus.Registerer
	// Groups are exported in converge_devbroker_group_members_evicted_total
	// at 0 from the start (a dashboard shows 0, not "no data", before the
	// first eviction); other groups appear with their first eviction.
	// Defaults to none.
	Groups []string
}

func (c *Config) setDefaults() {
	if c.ScanInterval == 0 {
		c.ScanInterval = time.Second
	}
	if c.Confirmations == 0 {
		c.Confirmations = 2
	}
	if c.RestoredGrace == 0 {
		c.RestoredGrace = 15 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
}

// Validate reports an invalid field.
func (c *Config) Validate() error {
	switch {
	case c.ScanInterval < 0:
		return fmt.Errorf("devbroker: ScanInterval %s is negative", c.ScanInterval)
	case c.Confirmations < 1:
		return fmt.Errorf("devbroker: Confirmations %d is below 1", c.Confirmations)
	case c.RestoredGrace < 0:
		return fmt.Errorf("devbroker: RestoredGrace %s is negative", c.RestoredGrace)
	}
	return nil
}

// Sentinel errors of Stop and Restart.
var (
	// ErrNoDataDir: Stop and Restart need Config.DataDir, or the
	// cluster's topics, records and offsets would be lost.
	ErrNoDataDir = errors.New("devbroker: Stop and Restart need Config.DataDir")
	// ErrRunning: Restart of a broker that was not stopped.
	ErrRunning = errors.New("devbroker: the broker is running (Stop it first)")
	// ErrClosed: Stop or Restart after Close.
	ErrClosed = errors.New("devbroker: the broker is closed")
)

// Broker is a running kfake cluster with its reaper. Close stops both.
// Stop and Restart take the cluster away and bring it back on the same
// addresses with the state it persisted (a Kafka outage on demand: the
// kafka-outage experiment of cmd/converge/internal/experiment).
type Broker struct {
	cfg     Config
	conns   *conns
	m       *metrics
	evicted atomic.Int64
	addrs   []string // fixed at Start: Restart listens on the same ports
	ports   []int

	mu      sync.Mutex // guards the fields below; held through Stop, Restart and Close
	kc      *kfake.Cluster
	cl      *kgo.Client
	cancel  context.CancelFunc
	done    chan struct{}
	stopped bool
	closed  bool
}

// Start starts the kfake cluster with cfg.Opts and the reaper. It returns
// an error when the configuration is invalid, the cluster cannot listen
// or cannot load cfg.DataDir, or the metrics are already registered on
// cfg.Registerer.
func Start(cfg Config) (*Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cs := newConns()
	m, err := newMetrics(cfg.Registerer, cs)
	if err != nil {
		return nil, err
	}
	for _, g := range cfg.Groups {
		m.evicted.WithLabelValues(g)
	}
	b := &Broker{cfg: cfg, conns: cs, m: m}
	if err := b.start(nil); err != nil {
		m.unregister(cfg.Registerer)
		return nil, err
	}
	b.addrs = b.kc.ListenAddrs()
	for _, a := range b.addrs {
		p, err := port(a)
		if err != nil {
			b.Close()
			m.unregister(cfg.Registerer)
			return nil, err
		}
		b.ports = append(b.ports, p)
	}
	return b, nil
}

// port returns the port of a host:port listen address.
func port(addr string) (int, error) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, fmt.Errorf("devbroker: listen address %q: %w", addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		return 0, fmt.Errorf("devbroker: listen address %q: %w", addr, err)
	}
	return n, nil
}

// start creates the cluster (on ports when given) and its reaper.
func (b *Broker) start(ports []int) error {
	listen := func(network, address string) (net.Listener, error) {
		ln, err := net.Listen(network, address)
		if err != nil {
			return nil, err
		}
		return &listener{Listener: ln, conns: b.conns}, nil
	}
	opts := append(b.cfg.Opts[:len(b.cfg.Opts):len(b.cfg.Opts)], kfake.ListenFn(listen))
	if b.cfg.DataDir != "" {
		opts = append(opts, kfake.DataDir(b.cfg.DataDir))
	}
	if len(ports) > 0 {
		opts = append(opts, kfake.Ports(ports...))
	}
	kc, err := kfake.NewCluster(opts...)
	if err != nil {
		return err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.ListenAddrs()...), kgo.ClientID(ClientID))
	if err != nil {
		kc.Close()
		return fmt.Errorf("devbroker: reaper client: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	// A reaper of its own per start: its first scan after a Restart finds
	// the members kfake restored from DataDir, which get RestoredGrace to
	// reconnect.
	r := &reaper{cfg: b.cfg, log: b.cfg.Logger, conns: b.conns, cl: cl, m: b.m, evicted: &b.evicted, suspects: map[memberKey]int{}}
	go func() {
		defer close(done)
		r.run(ctx)
	}()
	b.kc, b.cl, b.cancel, b.done = kc, cl, cancel, done
	return nil
}

// stop stops the reaper and then the cluster, which persists its state to
// DataDir (when set) and closes its listeners and every client connection.
func (b *Broker) stop() {
	b.cancel()
	<-b.done
	b.cl.Close()
	b.kc.Close()
	b.kc, b.cl = nil, nil
}

// Cluster returns the running kfake cluster (ControlKey, ...), nil while
// the broker is stopped or closed. A Restart replaces it.
func (b *Broker) Cluster() *kfake.Cluster {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.kc
}

// ListenAddrs returns the brokers' host:port addresses, the same while
// stopped and after a Restart.
func (b *Broker) ListenAddrs() []string { return slices.Clone(b.addrs) }

// Evicted returns how many members the reaper has evicted so far (over
// every Restart).
func (b *Broker) Evicted() int64 { return b.evicted.Load() }

// Stop takes the cluster away until Restart: kfake writes its state to
// DataDir (topics, records, committed offsets, producer ids and sequence
// windows, group sessions; see kfake.DataDir), then closes its listeners
// and every client connection, so clients get connection refused on the
// addresses of ListenAddrs. A stopped broker's Stop is a no-op. Errors:
// ErrNoDataDir when Config.DataDir is empty (nothing would survive),
// ErrClosed after Close.
func (b *Broker) Stop() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.restartable(); err != nil || b.stopped {
		return err
	}
	b.stop()
	b.stopped = true
	return nil
}

// Restart starts the cluster again after Stop, on the same ports and with
// the state reloaded from DataDir, and a new reaper (its RestoredGrace
// counts from now). Errors: ErrRunning when the broker was not stopped,
// ErrClosed after Close, ErrNoDataDir without Config.DataDir, or kfake's
// error when a port is taken meanwhile or DataDir cannot be loaded (the
// broker stays stopped; Restart may be called again).
func (b *Broker) Restart() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.restartable(); err != nil {
		return err
	}
	if !b.stopped {
		return ErrRunning
	}
	if err := b.start(b.ports); err != nil {
		return fmt.Errorf("devbroker: restart on %v: %w", b.addrs, err)
	}
	b.stopped = false
	return nil
}

// restartable reports why the broker can be neither stopped nor
// restarted: ErrClosed, ErrNoDataDir; b.mu is held.
func (b *Broker) restartable() error {
	switch {
	case b.closed:
		return ErrClosed
	case b.cfg.DataDir == "":
		return ErrNoDataDir
	}
	return nil
}

// Close stops the reaper and then the cluster. It is safe to call more
// than once, and on a stopped broker.
func (b *Broker) Close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	b.closed = true
	if !b.stopped {
		b.stop()
	}
}
