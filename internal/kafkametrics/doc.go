// Package kafkametrics exports the Kafka side of converge's metrics:
// consumer-group lag computed in the application, and the franz-go client
// metrics of the kprom plugin.
//
// # Consumer-group lag (LagSampler)
//
// Lag is computed from committed offsets and end offsets only: kadm
// FetchOffsets (OffsetFetch) per group, ListEndOffsets (high watermarks) and
// ListStartOffsets per topic. It never uses DescribeGroups or kadm's Lag
// helpers, which real Kafka refuses for next-generation (KIP-848) groups
// (DESIGN.md, Pitfalls). Lag of a partition = high watermark - committed
// offset, or - log start offset when the group has committed nothing there
// yet (converge's groups reset to the earliest offset), never below 0.
//
// Lag in seconds is the age of the next record the group will consume: the
// sampler reads the record at the committed offset with one Fetch request
// to the partition's leader and reports now - its timestamp (the producer's
// CreateTime, or the broker's LogAppendTime when the topic is configured so).
// This is the "how long has the oldest unconsumed record been waiting"
// measure of kafka-lag-exporter and Burrow, not an extrapolation from the
// consumption rate: it keeps growing while a group is stopped and is exact
// right after a restart. It is 0 without lag; the series is absent when the
// record cannot be read (deleted by retention, fetch error; counted in the
// errors counter).
//
// One sample runs at once at Run and then every LagConfig.Interval; the
// metrics always show the last successful sample (series of partitions and
// groups that disappeared disappear with it). Names follow kafka_exporter
// (danielqsj/kafka_exporter: kafka_consumergroup_lag{consumergroup,topic,
// partition}, kafka_consumergroup_current_offset, kafka_topic_partition_
// current_offset, kafka_topic_partition_oldest_offset) with the converge_
// prefix, so its users' queries and dashboards carry over; the seconds
// gauge takes kafka-lag-exporter's name suffix (_lag_seconds).
//
// Run one sampler per deployment (converge runs it in the reconciler, and in
// the single-process pipeline): several samplers export the same series from
// several targets, which queries then have to collapse with max by
// (consumergroup, topic, partition).
//
// # Client metrics (ClientMetrics)
//
// ClientMetrics attaches a kprom.Metrics to one franz-go client. Its series
// are converge_kafka_client_<name>{component, node_id[, topic]} for the
// kprom names connects_total, connect_errors_total, disconnects_total,
// write_bytes_total, write_errors_total, read_bytes_total,
// read_errors_total (per broker, label node_id), produce_bytes_total,
// produce_compressed_bytes_total, produce_batches_total,
// produce_records_total, fetch_bytes_total, fetch_compressed_bytes_total,
// fetch_batches_total, fetch_records_total (labels node_id, topic), the
// gauges buffered_produce_records_total, buffered_produce_bytes,
// buffered_fetch_records_total, buffered_fetch_bytes, and the
// request_duration_e2e_seconds histogram (plugin/kprom documents each).
// The constant label component (relay, worker, projector, ...) keeps
// several clients of one process apart.
//
// # Metrics
//
//	name                                                        type     labels                          meaning
//	converge_kafka_consumergroup_lag                            gauge    consumergroup, topic, partition records not consumed yet (messages)
//	converge_kafka_consumergroup_lag_seconds                    gauge    consumergroup, topic, partition age of the next record to consume, seconds; 0 without lag
//	converge_kafka_consumergroup_current_offset                 gauge    consumergroup, topic, partition committed offset (absent without a commit)
//	converge_kafka_topic_partition_current_offset               gauge    topic, partition                high watermark (end offset)
//	converge_kafka_topic_partition_oldest_offset                gauge    topic, partition                log start offset
//	converge_kafka_consumergroup_lag_sample_timestamp_seconds   gauge    -                               Unix time of the last successful sample
//	converge_kafka_consumergroup_lag_sample_errors_total        counter  -                               failed samples and unreadable next records
//	converge_kafka_client_*                                     various  component, node_id[, topic]     franz-go client metrics (kprom), see above
package kafkametrics
