package kafkametrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/plugin/kprom"
)

// ClientNamespace and ClientSubsystem prefix the franz-go client metrics:
// converge_kafka_client_<kprom name>.
const (
	ClientNamespace = "converge"
	ClientSubsystem = "kafka_client"
)

// ClientMetrics returns a kgo option that exports the franz-go client
// metrics of the kprom plugin (connections, bytes and errors per broker,
// produced and fetched bytes/records/batches per topic, buffered records,
// request latency histograms) on reg under converge_kafka_client_*, with the
// constant label component="<component>" so several clients of one process
// (relay, worker, projector) share the metric names without clashing.
//
// Each call returns a new kprom.Metrics: pass the option to ONE client. The
// metrics are registered when the client is created and unregistered when it
// is closed, so a component may create its client again after closing the
// previous one; two live clients with the same component and registry would
// panic on the duplicate registration.
func ClientMetrics(reg prometheus.Registerer, component string) kgo.Opt {
	m := kprom.NewMetrics(ClientNamespace,
		kprom.Subsystem(ClientSubsystem),
		kprom.Registerer(reg),
		kprom.WithStaticLabel(prometheus.Labels{"component": component}),
		kprom.Histograms(kprom.RequestDurationE2E),
		kprom.FetchAndProduceDetail(kprom.ByNode, kprom.ByTopic, kprom.Records, kprom.Batches,
			kprom.UncompressedBytes, kprom.CompressedBytes),
	)
	return kgo.WithHooks(m)
}
