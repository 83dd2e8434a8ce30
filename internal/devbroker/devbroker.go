package devbroker

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync"
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
	// DataDir, SyncWrites, ClusterID, DefaultNumPartitions, ...), passed
	// unchanged. Start appends kfake.ListenFn to track connections, which
	// overrides a ListenFn given here. Defaults to none (kfake's defaults:
	// three brokers on random ports).
	Opts []kfake.Opt
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

// Broker is a running kfake cluster with its reaper. Close stops both.
type Broker struct {
	// Cluster is the kfake cluster (ControlKey, ListenAddrs, ...).
	Cluster *kfake.Cluster

	conns   *conns
	reaper  *reaper
	cl      *kgo.Client
	cancel  context.CancelFunc
	done    chan struct{}
	closeMu sync.Once
}

// Start starts the kfake cluster with cfg.Opts and the reaper. It returns
// an error when the configuration is invalid, the cluster cannot listen, or
// the metrics are already registered on cfg.Registerer.
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
	listen := func(network, address string) (net.Listener, error) {
		ln, err := net.Listen(network, address)
		if err != nil {
			return nil, err
		}
		return &listener{Listener: ln, conns: cs}, nil
	}
	kc, err := kfake.NewCluster(append(cfg.Opts[:len(cfg.Opts):len(cfg.Opts)], kfake.ListenFn(listen))...)
	if err != nil {
		m.unregister(cfg.Registerer)
		return nil, err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.ListenAddrs()...), kgo.ClientID(ClientID))
	if err != nil {
		kc.Close()
		m.unregister(cfg.Registerer)
		return nil, fmt.Errorf("devbroker: reaper client: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b := &Broker{Cluster: kc, conns: cs, cl: cl, cancel: cancel, done: make(chan struct{}),
		reaper: &reaper{cfg: cfg, log: cfg.Logger, conns: cs, cl: cl, m: m, suspects: map[memberKey]int{}}}
	go func() {
		defer close(b.done)
		b.reaper.run(ctx)
	}()
	return b, nil
}

// ListenAddrs returns the brokers' host:port addresses.
func (b *Broker) ListenAddrs() []string { return b.Cluster.ListenAddrs() }

// Evicted returns how many members the reaper has evicted so far.
func (b *Broker) Evicted() int64 { return b.reaper.evicted.Load() }

// Close stops the reaper and then the cluster. It is safe to call more
// than once.
func (b *Broker) Close() {
	b.closeMu.Do(func() {
		b.cancel()
		<-b.done
		b.cl.Close()
		b.Cluster.Close()
	})
}
