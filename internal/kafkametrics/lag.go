package kafkametrics

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"golang.org/x/sync/errgroup"
)

// Defaults of LagConfig.
const (
	DefaultLagInterval = 10 * time.Second
	// timestampFetchConcurrency bounds the Fetch requests of one sample.
	timestampFetchConcurrency = 8
)

// Group is a consumer group sampled on known topics.
type Group struct {
	// Name is the consumer group id.
	Name string
	// Topics the group consumes. Partitions the group has not committed to
	// yet count from the log start offset (converge's groups reset to the
	// earliest offset). Topics that do not exist yet are skipped.
	Topics []string
}

// LagConfig configures a LagSampler.
type LagConfig struct {
	// Brokers are the Kafka seed brokers. Required.
	Brokers []string
	// Groups are sampled at every pass on their Topics, whether or not they
	// have committed anything yet. Defaults to none.
	Groups []Group
	// AllGroups also samples every group the cluster lists (ListGroups),
	// on the topics each has committed offsets for. Defaults to false.
	AllGroups bool
	// Interval between two samples; the first is taken at once. Defaults to
	// 10s.
	Interval time.Duration
	// Timeout bounds one sample. Defaults to Interval.
	Timeout time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the converge_kafka_consumergroup_* and
	// converge_kafka_topic_partition_* metrics. Defaults to a new, private
	// registry.
	Registerer prometheus.Registerer
	// KafkaOpts are appended to the sampler's franz-go client options.
	// Defaults to none.
	KafkaOpts []kgo.Opt
}

func (c *LagConfig) setDefaults() {
	if c.Interval == 0 {
		c.Interval = DefaultLagInterval
	}
	if c.Timeout == 0 {
		c.Timeout = c.Interval
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
}

// Validate reports every invalid field of c.
func (c *LagConfig) Validate() error {
	var errs []error
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("Brokers is required"))
	}
	if len(c.Groups) == 0 && !c.AllGroups {
		errs = append(errs, errors.New("no group to sample: set Groups or AllGroups"))
	}
	for i, g := range c.Groups {
		if g.Name == "" || len(g.Topics) == 0 {
			errs = append(errs, fmt.Errorf("Groups[%d]: Name and Topics are required", i))
		}
	}
	if c.Interval <= 0 {
		errs = append(errs, fmt.Errorf("Interval %s: must be positive", c.Interval))
	}
	if c.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("Timeout %s: must be positive", c.Timeout))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("lag sampler config: %w", err)
	}
	return nil
}

// PartitionLag is the lag of one consumer group on one partition, as of
// the sample that produced it.
type PartitionLag struct {
	Group     string
	Topic     string
	Partition int32
	// Committed is the group's committed offset (the next record it will
	// consume), or -1 when it has committed nothing on the partition.
	Committed int64
	// Start and End are the partition's log start offset and high
	// watermark.
	Start, End int64
	// Lag is End minus Committed (minus Start without a commit), never
	// below 0: records the group has not consumed yet.
	Lag int64
	// LagSeconds is how long the next record to consume has been waiting:
	// now minus its timestamp; 0 when Lag is 0; NaN when unknown (its
	// fetch failed or it was deleted by retention).
	LagSeconds float64
}

// snapshot is the result of one sample.
type snapshot struct {
	at         time.Time
	partitions []PartitionLag
}

// LagSampler computes consumer-group lag from committed offsets and end
// offsets (see the package documentation) every Interval and exports the
// last sample as metrics. It is a prometheus.Collector registered by
// NewLagSampler; series of groups and partitions that disappear disappear
// with the next sample.
type LagSampler struct {
	cfg     LagConfig
	log     *slog.Logger
	last    atomic.Pointer[snapshot]
	samples atomic.Int64
	errors  prometheus.Counter

	descLag, descLagSeconds, descCommitted, descEnd, descStart, descSampleTime *prometheus.Desc
}

var _ prometheus.Collector = (*LagSampler)(nil)

// NewLagSampler validates cfg (after defaults) and registers the sampler's
// metrics on cfg.Registerer. It does not connect to anything.
func NewLagSampler(cfg LagConfig) (*LagSampler, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	groupLabels := []string{"consumergroup", "topic", "partition"}
	partLabels := []string{"topic", "partition"}
	s := &LagSampler{
		cfg: cfg,
		log: cfg.Logger,
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "converge_kafka_consumergroup_lag_sample_errors_total",
			Help: "Lag samples that failed (the previous sample stays exported), plus partitions whose lag in seconds could not be determined.",
		}),
		descLag: prometheus.NewDesc("converge_kafka_consumergroup_lag",
			"Records of the partition the consumer group has not consumed: high watermark minus committed offset (minus log start offset without a commit).", groupLabels, nil),
		descLagSeconds: prometheus.NewDesc("converge_kafka_consumergroup_lag_seconds",
			"Age of the next record the consumer group will consume (now minus its timestamp), in seconds; 0 without lag.", groupLabels, nil),
		descCommitted: prometheus.NewDesc("converge_kafka_consumergroup_current_offset",
			"Committed offset of the consumer group on the partition (absent without a commit).", groupLabels, nil),
		descEnd: prometheus.NewDesc("converge_kafka_topic_partition_current_offset",
			"High watermark (end offset) of the partition.", partLabels, nil),
		descStart: prometheus.NewDesc("converge_kafka_topic_partition_oldest_offset",
			"Log start offset of the partition.", partLabels, nil),
		descSampleTime: prometheus.NewDesc("converge_kafka_consumergroup_lag_sample_timestamp_seconds",
			"Unix time of the last successful lag sample.", nil, nil),
	}
	for _, c := range []prometheus.Collector{s, s.errors} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, fmt.Errorf("register consumer group lag metrics: %w", err)
		}
	}
	return s, nil
}

// Describe implements prometheus.Collector.
func (s *LagSampler) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{s.descLag, s.descLagSeconds, s.descCommitted, s.descEnd, s.descStart, s.descSampleTime} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: the last sample, nothing before
// the first.
func (s *LagSampler) Collect(ch chan<- prometheus.Metric) {
	snap := s.last.Load()
	if snap == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(s.descSampleTime, prometheus.GaugeValue, float64(snap.at.UnixNano())/1e9)
	type tp struct {
		topic string
		p     int32
	}
	seen := map[tp]bool{}
	for _, pl := range snap.partitions {
		p := strconv.Itoa(int(pl.Partition))
		ch <- prometheus.MustNewConstMetric(s.descLag, prometheus.GaugeValue, float64(pl.Lag), pl.Group, pl.Topic, p)
		if !math.IsNaN(pl.LagSeconds) {
			ch <- prometheus.MustNewConstMetric(s.descLagSeconds, prometheus.GaugeValue, pl.LagSeconds, pl.Group, pl.Topic, p)
		}
		if pl.Committed >= 0 {
			ch <- prometheus.MustNewConstMetric(s.descCommitted, prometheus.GaugeValue, float64(pl.Committed), pl.Group, pl.Topic, p)
		}
		if k := (tp{pl.Topic, pl.Partition}); !seen[k] {
			seen[k] = true
			ch <- prometheus.MustNewConstMetric(s.descEnd, prometheus.GaugeValue, float64(pl.End), pl.Topic, p)
			ch <- prometheus.MustNewConstMetric(s.descStart, prometheus.GaugeValue, float64(pl.Start), pl.Topic, p)
		}
	}
}

// Last returns the partitions of the last successful sample (sorted by
// group, topic, partition) and its time; nil before the first.
func (s *LagSampler) Last() ([]PartitionLag, time.Time) {
	snap := s.last.Load()
	if snap == nil {
		return nil, time.Time{}
	}
	return slices.Clone(snap.partitions), snap.at
}

// Samples returns how many samples succeeded so far.
func (s *LagSampler) Samples() int64 { return s.samples.Load() }

// Run samples at once and then every Interval until ctx is cancelled, then
// returns nil. A failed sample is logged and counted; the previous one stays
// exported. It returns an error only when the Kafka client cannot be
// created.
func (s *LagSampler) Run(ctx context.Context) error {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(s.cfg.Brokers...)}, s.cfg.KafkaOpts...)...)
	if err != nil {
		return fmt.Errorf("lag sampler: create kafka client: %w", err)
	}
	defer cl.Close()
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		sctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		err := s.sample(sctx, cl)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			s.errors.Inc()
			s.log.WarnContext(ctx, "consumer group lag sample failed", slog.String("error", err.Error()))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// sample computes the lag of every configured (and, with AllGroups, every
// listed) group and stores it as the last snapshot.
func (s *LagSampler) sample(ctx context.Context, cl *kgo.Client) error {
	adm := kadm.NewClient(cl)
	wanted := map[string][]string{} // group -> topics it must cover
	for _, g := range s.cfg.Groups {
		wanted[g.Name] = append(wanted[g.Name], g.Topics...)
	}
	if s.cfg.AllGroups {
		listed, err := adm.ListGroups(ctx)
		if err != nil {
			return fmt.Errorf("list groups: %w", err)
		}
		for _, g := range listed.Groups() {
			if _, ok := wanted[g]; !ok {
				wanted[g] = nil
			}
		}
	}

	// Committed offsets: kadm FetchOffsets (OffsetFetch), never
	// DescribeGroups, which real Kafka refuses for KIP-848 groups.
	committed := map[string]kadm.OffsetResponses{}
	topicSet := map[string]bool{}
	for g, topics := range wanted {
		resp, err := adm.FetchOffsets(ctx, g)
		if errors.Is(err, kerr.GroupIDNotFound) {
			resp, err = nil, nil // no member and no commit yet
		}
		if err != nil {
			return fmt.Errorf("fetch committed offsets of group %s: %w", g, err)
		}
		committed[g] = resp
		for _, t := range topics {
			topicSet[t] = true
		}
		for t := range resp {
			topicSet[t] = true
		}
	}
	if len(topicSet) == 0 {
		s.store(nil)
		return nil
	}
	topics := make([]string, 0, len(topicSet))
	for t := range topicSet {
		topics = append(topics, t)
	}
	meta, err := adm.Metadata(ctx, topics...)
	if err != nil {
		return fmt.Errorf("metadata of %v: %w", topics, err)
	}
	ends, err := adm.ListEndOffsets(ctx, topics...)
	if err != nil {
		return fmt.Errorf("list end offsets: %w", err)
	}
	starts, err := adm.ListStartOffsets(ctx, topics...)
	if err != nil {
		return fmt.Errorf("list start offsets: %w", err)
	}

	var parts []PartitionLag
	for g, topics := range wanted {
		for _, t := range topicsOf(topics, committed[g]) {
			td, ok := meta.Topics[t]
			if !ok || td.Err != nil {
				continue // not created yet (or deleted)
			}
			for p := range td.Partitions {
				end, ok := ends.Lookup(t, p)
				if !ok || end.Err != nil {
					return fmt.Errorf("end offset of %s/%d: %v", t, p, end.Err)
				}
				start, ok := starts.Lookup(t, p)
				if !ok || start.Err != nil {
					return fmt.Errorf("start offset of %s/%d: %v", t, p, start.Err)
				}
				pl := PartitionLag{Group: g, Topic: t, Partition: p, Committed: -1, Start: start.Offset, End: end.Offset}
				if c, ok := committed[g].Lookup(t, p); ok && c.Err == nil && c.At >= 0 {
					pl.Committed = c.At
				}
				next := pl.Committed
				if next < 0 {
					next = pl.Start
				}
				pl.Lag = max(pl.End-next, 0)
				if pl.Lag == 0 {
					pl.LagSeconds = 0
				} else {
					pl.LagSeconds = math.NaN() // filled below
				}
				parts = append(parts, pl)
			}
		}
	}
	s.fillLagSeconds(ctx, cl, meta, parts)
	slices.SortFunc(parts, func(a, b PartitionLag) int {
		return cmp.Or(strings.Compare(a.Group, b.Group), strings.Compare(a.Topic, b.Topic), cmp.Compare(a.Partition, b.Partition))
	})
	s.store(parts)
	return nil
}

func (s *LagSampler) store(parts []PartitionLag) {
	s.last.Store(&snapshot{at: time.Now(), partitions: parts})
	s.samples.Add(1)
}

// topicsOf returns the configured topics plus those the group committed to,
// without duplicates.
func topicsOf(configured []string, committed kadm.OffsetResponses) []string {
	out := slices.Clone(configured)
	for t := range committed {
		if !slices.Contains(out, t) {
			out = append(out, t)
		}
	}
	return out
}

// fillLagSeconds sets LagSeconds of every lagging partition from the
// timestamp of the next record to consume (the committed offset, or the log
// start offset without a commit), read with one Fetch request to the
// partition's leader. Partitions whose record cannot be read keep NaN and
// are counted as errors. Records of one fetch are shared by the groups at
// the same offset.
func (s *LagSampler) fillLagSeconds(ctx context.Context, cl *kgo.Client, meta kadm.Metadata, parts []PartitionLag) {
	type key struct {
		topic string
		p     int32
		at    int64
	}
	ts := map[key]time.Time{}
	for _, pl := range parts {
		if pl.Lag > 0 {
			at := pl.Committed
			if at < 0 {
				at = pl.Start
			}
			ts[key{pl.Topic, pl.Partition, at}] = time.Time{}
		}
	}
	if len(ts) == 0 {
		return
	}
	type result struct {
		k  key
		ts time.Time
	}
	results := make(chan result, len(ts))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(timestampFetchConcurrency)
	for k := range ts {
		td := meta.Topics[k.topic]
		leader := td.Partitions[k.p].Leader
		g.Go(func() error {
			t, err := recordTimestamp(gctx, cl, leader, td.ID, k.topic, k.p, k.at)
			if err != nil {
				s.errors.Inc()
				s.log.DebugContext(gctx, "read timestamp of next record failed", slog.String("topic", k.topic),
					slog.Int("partition", int(k.p)), slog.Int64("offset", k.at), slog.String("error", err.Error()))
				return nil
			}
			results <- result{k, t}
			return nil
		})
	}
	_ = g.Wait()
	close(results)
	for r := range results {
		ts[r.k] = r.ts
	}
	now := time.Now()
	for i := range parts {
		pl := &parts[i]
		if pl.Lag == 0 {
			continue
		}
		at := pl.Committed
		if at < 0 {
			at = pl.Start
		}
		if t := ts[key{pl.Topic, pl.Partition, at}]; !t.IsZero() {
			pl.LagSeconds = max(now.Sub(t).Seconds(), 0)
		}
	}
}

// recordTimestamp reads the timestamp of the record at offset of
// topic/partition with a Fetch request to the partition's leader.
func recordTimestamp(ctx context.Context, cl *kgo.Client, leader int32, id kadm.TopicID, topic string, partition int32, offset int64) (time.Time, error) {
	if leader < 0 {
		return time.Time{}, fmt.Errorf("%s/%d has no leader", topic, partition)
	}
	req := kmsg.NewPtrFetchRequest()
	req.MaxWaitMillis = 0
	req.MinBytes = 1
	req.MaxBytes = 1 << 20
	rt := kmsg.NewFetchRequestTopic()
	rt.Topic = topic
	rt.TopicID = id
	rp := kmsg.NewFetchRequestTopicPartition()
	rp.Partition = partition
	rp.FetchOffset = offset
	rp.PartitionMaxBytes = 1 << 20 // the first batch is returned even when larger (KIP-74)
	rt.Partitions = append(rt.Partitions, rp)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl.Broker(int(leader)))
	if err != nil {
		return time.Time{}, fmt.Errorf("fetch %s/%d at %d: %w", topic, partition, offset, err)
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return time.Time{}, fmt.Errorf("fetch %s/%d at %d: %w", topic, partition, offset, err)
	}
	for i := range resp.Topics {
		for j := range resp.Topics[i].Partitions {
			rpr := &resp.Topics[i].Partitions[j]
			if rpr.Partition != partition {
				continue
			}
			fp, _ := kgo.ProcessFetchPartition(kgo.ProcessFetchPartitionOpts{
				Offset: offset, Topic: topic, Partition: partition,
			}, rpr, kgo.DefaultDecompressor(), nil)
			if fp.Err != nil {
				return time.Time{}, fmt.Errorf("fetch %s/%d at %d: %w", topic, partition, offset, fp.Err)
			}
			for _, r := range fp.Records {
				if r.Offset >= offset {
					return r.Timestamp, nil
				}
			}
		}
	}
	return time.Time{}, fmt.Errorf("fetch %s/%d at %d: no record returned", topic, partition, offset)
}
