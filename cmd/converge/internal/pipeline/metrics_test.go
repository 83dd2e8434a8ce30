package pipeline_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/cmd/converge/internal/pipeline"
	"github.com/converge-run/converge/consumers/worker"
	"github.com/converge-run/converge/internal/testenv"
	"github.com/converge-run/converge/projections/taskview"
)

// documentedMetric is a metric a component's doc.go lists, with the label
// names of its series (histogram "le" excluded).
type documentedMetric struct {
	doc    string // package directory whose doc.go documents it
	name   string
	labels []string
	// onEvent: the series appear only once the event they count happened
	// (a vector without pre-initialized labels); absent is fine, present
	// must carry the labels.
	onEvent bool
}

var documentedMetrics = []documentedMetric{
	// services/api
	{doc: "services/api", name: "converge_api_requests_total", labels: []string{"route", "method", "code"}},
	{doc: "services/api", name: "converge_api_request_duration_seconds", labels: []string{"route", "method"}},
	{doc: "services/api", name: "converge_api_idempotency_total", labels: []string{"outcome"}},
	{doc: "services/api", name: "converge_api_create_batch_size"},
	{doc: "services/api", name: "converge_api_create_group_aborts_total"},
	{doc: "services/api", name: "converge_cache_requests_total", labels: []string{"result"}},
	// cdc
	{doc: "cdc", name: "converge_relay_events_published_total", labels: []string{"event_type"}},
	{doc: "cdc", name: "converge_relay_produce_errors_total"},
	{doc: "cdc", name: "converge_relay_payload_hash_mismatches_total"},
	{doc: "cdc", name: "converge_relay_commit_to_ack_seconds"},
	{doc: "cdc", name: "converge_relay_confirmed_lsn"},
	{doc: "cdc", name: "converge_relay_last_acked_lsn"},
	{doc: "cdc", name: "converge_relay_slot_lag_bytes"},
	{doc: "cdc", name: "converge_relay_slot_retained_wal_bytes"},
	{doc: "cdc", name: "converge_relay_slot_wal_status", labels: []string{"status"}},
	{doc: "cdc", name: "converge_relay_slot_sample_errors_total"},
	{doc: "cdc", name: "converge_relay_heartbeats_emitted_total"},
	{doc: "cdc", name: "converge_relay_heartbeat_errors_total"},
	{doc: "cdc", name: "converge_relay_heartbeat_rtt_seconds"},
	{doc: "cdc", name: "converge_relay_heartbeat_last_received_timestamp_seconds"},
	{doc: "cdc", name: "converge_relay_transactions_in_flight"},
	{doc: "cdc", name: "converge_relay_records_in_flight"},
	{doc: "cdc", name: "converge_relay_outbox_transactions_recorded_total"},
	{doc: "cdc", name: "converge_relay_outbox_rows_already_published_total"},
	{doc: "cdc", name: "converge_relay_outbox_rows_not_yet_visible_total"},
	{doc: "cdc", name: "converge_relay_outbox_rows_gone_total"},
	{doc: "cdc", name: "converge_relay_status_updates_total"},
	{doc: "cdc", name: "converge_relay_outbox_rows_parked_total", labels: []string{"code"}, onEvent: true},
	{doc: "cdc", name: "converge_relay_restarts_total", labels: []string{"reason"}},
	{doc: "cdc", name: "converge_relay_streaming"},
	{doc: "cdc", name: "converge_relay_publication_mismatch", labels: []string{"reason"}},
	{doc: "cdc", name: "converge_relay_publication_mismatches_total", labels: []string{"reason"}},
	// cmd/converge/internal/pipeline
	{doc: "cmd/converge/internal/pipeline", name: "converge_component_restarts_total", labels: []string{"component"}},
	// consumers/worker
	{doc: "consumers/worker", name: "converge_worker_messages_total", labels: []string{"outcome"}},
	{doc: "consumers/worker", name: "converge_worker_batched_records_total"},
	{doc: "consumers/worker", name: "converge_worker_group_records"},
	{doc: "consumers/worker", name: "converge_worker_effect_transitions_total", labels: []string{"kind", "state"}},
	{doc: "consumers/worker", name: "converge_worker_processing_seconds"},
	{doc: "consumers/worker", name: "converge_worker_task_end_to_end_seconds"},
	{doc: "consumers/worker", name: "converge_deadletter_published_total", labels: []string{"error_code"}, onEvent: true},
	// consumers/reconciler
	{doc: "consumers/reconciler", name: "converge_reconciler_actions_total", labels: []string{"kind"}},
	{doc: "consumers/reconciler", name: "converge_reconciler_passes_total", labels: []string{"result"}},
	{doc: "consumers/reconciler", name: "converge_reconciler_pass_seconds"},
	{doc: "consumers/reconciler", name: "converge_deadletter_unresolved"},
	{doc: "consumers/reconciler", name: "converge_outbox_unpublished_rows"},
	{doc: "consumers/reconciler", name: "converge_outbox_oldest_unpublished_age_seconds"},
	{doc: "consumers/reconciler", name: "converge_outbox_parked_rows"},
	{doc: "consumers/reconciler", name: "converge_reconciler_expired_tasks"},
	// consumers/deadletter
	{doc: "consumers/deadletter", name: "converge_deadletter_replays_total", labels: []string{"outcome"}, onEvent: true},
	// projections/taskview
	{doc: "projections/taskview", name: "converge_projector_events_total", labels: []string{"outcome"}},
	{doc: "projections/taskview", name: "converge_projector_redis_errors_total"},
	{doc: "projections/taskview", name: "converge_cache_stale_writes_rejected_total"},
	// internal/kafkametrics
	{doc: "internal/kafkametrics", name: "converge_kafka_consumergroup_lag", labels: []string{"consumergroup", "topic", "partition"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_consumergroup_lag_seconds", labels: []string{"consumergroup", "topic", "partition"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_consumergroup_current_offset", labels: []string{"consumergroup", "topic", "partition"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_topic_partition_current_offset", labels: []string{"topic", "partition"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_topic_partition_oldest_offset", labels: []string{"topic", "partition"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_consumergroup_lag_sample_timestamp_seconds"},
	{doc: "internal/kafkametrics", name: "converge_kafka_consumergroup_lag_sample_errors_total"},
	{doc: "internal/kafkametrics", name: "converge_kafka_client_connects_total", labels: []string{"component", "node_id"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_client_produce_records_total", labels: []string{"component", "node_id", "topic"}},
	{doc: "internal/kafkametrics", name: "converge_kafka_client_fetch_records_total", labels: []string{"component", "node_id", "topic"}},
}

// repoRoot is the module root (this file is internal/pipeline/...).
func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("no caller information")
	}
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "..") // cmd/converge/internal/pipeline -> root
}

// scrape GETs /metrics of the pipeline and parses the text format.
func (b *bundle) scrape(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(b.baseURL + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return mfs
}

func labelsOf(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// sumWhere adds the values of the gauge series of name whose labels include
// match; ok is false when there is no such series.
func sumWhere(mfs map[string]*dto.MetricFamily, name string, match map[string]string) (sum float64, ok bool) {
	mf := mfs[name]
	if mf == nil {
		return 0, false
	}
series:
	for _, m := range mf.GetMetric() {
		ls := labelsOf(m)
		for k, v := range match {
			if ls[k] != v {
				continue series
			}
		}
		sum += m.GetGauge().GetValue()
		ok = true
	}
	return sum, ok
}

// TestMetricsScrape runs the pipeline, drives every API outcome through it,
// scrapes /metrics over HTTP and checks that each metric a doc.go lists is
// exported with the documented labels; then stops a consumer group and
// checks that its lag gauges grow while the pipeline's own groups catch up
// to zero.
func TestMetricsScrape(t *testing.T) {
	t.Parallel()
	b := setupWith(t, func(cfg *pipeline.Config) {
		cfg.LagSampleInterval = 50 * time.Millisecond
		cfg.HeartbeatInterval = 100 * time.Millisecond
		cfg.SlotSampleInterval = 100 * time.Millisecond
	})
	ctx := context.Background()

	// A consumer group that reads the topic once and then stops.
	const stopped = "metrics-test-stopped"
	cons := b.kafka.Client(t, kgo.ConsumerGroup(stopped), kgo.ConsumeTopics(b.kafka.Topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())

	// created, replayed, key reused, completed, cache reads.
	created := func(key string, doc string) string {
		t.Helper()
		r, err := b.client.Create(ctx, key, []byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		return r.TaskID
	}
	id := created("metrics-key-0001", `{"b": 2, "a": 1}`)
	if resp, _ := b.post(t, "metrics-key-0001", []byte(`{"document": {"b": 2, "a": 1}}`)); resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %s without Idempotent-Replayed", resp.Status)
	}
	if resp, body := b.post(t, "metrics-key-0001", []byte(`{"document": {"c": 3}}`)); resp.StatusCode != http.StatusUnprocessableEntity {
		t.Fatalf("key reused: %s %s", resp.Status, body)
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if task, err := b.client.Wait(wctx, id); err != nil || task.Status != "completed" {
		t.Fatalf("task %s: %+v, %v", id, task, err)
	}
	if _, err := b.client.Get(ctx, id); err != nil {
		t.Fatal(err)
	}

	// The stopped group consumes what is there and commits.
	for {
		fs := cons.PollFetches(wctx)
		if wctx.Err() != nil {
			t.Fatal("stopped group: consume:", wctx.Err())
		}
		if fs.NumRecords() > 0 {
			break
		}
	}
	if err := cons.CommitUncommittedOffsets(wctx); err != nil {
		t.Fatal(err)
	}
	var lagBefore float64
	testenv.Eventually(t, 20*time.Second, "lag of every group sampled", func() bool {
		mfs := b.scrape(t)
		_, okS := sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": stopped})
		_, okW := sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": worker.DefaultGroup})
		_, okP := sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": taskview.DefaultGroup})
		lagBefore, _ = sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": stopped})
		return okS && okW && okP
	})
	cons.Close() // the consumer stops

	// More traffic while the group is stopped.
	var ids []string
	for i := range 6 {
		ids = append(ids, created(fmt.Sprintf("metrics-key-%04d", i+2), fmt.Sprintf(`{"n": %d}`, i)))
	}
	for _, id := range ids {
		if task, err := b.client.Wait(wctx, id); err != nil || task.Status != "completed" {
			t.Fatalf("task %s: %+v, %v", id, task, err)
		}
	}
	testenv.Eventually(t, 20*time.Second, "stopped group lags; worker and projector caught up", func() bool {
		mfs := b.scrape(t)
		s, _ := sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": stopped})
		w, _ := sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": worker.DefaultGroup})
		p, _ := sumWhere(mfs, "converge_kafka_consumergroup_lag", map[string]string{"consumergroup": taskview.DefaultGroup})
		// 6 TaskCreated + 6 TaskCompleted records at least.
		return s >= lagBefore+12 && w == 0 && p == 0
	})
	mfs := b.scrape(t)
	if secs, ok := sumWhere(mfs, "converge_kafka_consumergroup_lag_seconds", map[string]string{"consumergroup": stopped}); !ok || secs <= 0 {
		t.Errorf("lag seconds of the stopped group = %v (present %v), want > 0", secs, ok)
	}
	if secs, _ := sumWhere(mfs, "converge_kafka_consumergroup_lag_seconds", map[string]string{"consumergroup": worker.DefaultGroup}); secs != 0 {
		t.Errorf("lag seconds of the worker group = %v, want 0", secs)
	}

	// Every documented metric, with its labels, and listed in its doc.go.
	testenv.Eventually(t, 20*time.Second, "heartbeat received and slot sampled", func() bool {
		mfs := b.scrape(t)
		hb, _ := sumWhere(mfs, "converge_relay_heartbeat_last_received_timestamp_seconds", nil)
		reserved, _ := sumWhere(mfs, "converge_relay_slot_wal_status", map[string]string{"status": "reserved"})
		return hb > 0 && reserved == 1
	})
	mfs = b.scrape(t)
	root := repoRoot(t)
	docs := map[string]string{}
	for _, dm := range documentedMetrics {
		if _, ok := docs[dm.doc]; !ok {
			text, err := os.ReadFile(filepath.Join(root, dm.doc, "doc.go"))
			if err != nil {
				t.Fatal(err)
			}
			docs[dm.doc] = string(text)
		}
		doc := docs[dm.doc]
		documented := strings.Contains(doc, dm.name)
		if suffix, ok := strings.CutPrefix(dm.name, "converge_kafka_client_"); ok {
			documented = strings.Contains(doc, "converge_kafka_client_") && strings.Contains(doc, suffix)
		}
		if !documented {
			t.Errorf("%s is not documented in %s/doc.go", dm.name, dm.doc)
		}
		mf := mfs[dm.name]
		if mf == nil || len(mf.GetMetric()) == 0 {
			if !dm.onEvent {
				t.Errorf("%s: not exported", dm.name)
			}
			continue
		}
		want := slices.Clone(dm.labels)
		slices.Sort(want)
		for _, m := range mf.GetMetric() {
			var got []string
			for name := range labelsOf(m) {
				got = append(got, name)
			}
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Errorf("%s: series with labels %v, documented %v", dm.name, got, want)
				break
			}
		}
	}
	// API idempotency outcomes of the traffic above.
	for _, outcome := range []string{"created", "replayed", "key_reused"} {
		if mf := mfs["converge_api_idempotency_total"]; mf == nil || !hasLabel(mf, "outcome", outcome) {
			t.Errorf("converge_api_idempotency_total{outcome=%q} missing", outcome)
		}
	}
	for _, c := range []string{"relay", "worker", "projector"} {
		if mf := mfs["converge_kafka_client_connects_total"]; mf == nil || !hasLabel(mf, "component", c) {
			t.Errorf("converge_kafka_client_connects_total{component=%q} missing", c)
		}
	}
}

func hasLabel(mf *dto.MetricFamily, name, value string) bool {
	for _, m := range mf.GetMetric() {
		if labelsOf(m)[name] == value {
			return true
		}
	}
	return false
}
