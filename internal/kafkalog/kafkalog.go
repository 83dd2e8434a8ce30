// Package kafkalog is the one logger of converge's Kafka clients: franz-go's
// logs through its kslog plugin into a log/slog logger, with franz-go's info
// logs (joins, metadata refreshes, rebalances, flushes: routine) shown only
// when that logger logs at debug level.
package kafkalog

import (
	"context"
	"log/slog"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/plugin/kslog"
)

// New returns the kgo.Logger for l (kgo.WithLogger(kafkalog.New(l))).
func New(l *slog.Logger) kgo.Logger {
	return kslog.New(slog.New(quietInfo{l.Handler()}))
}

// quietInfo is a slog.Handler that drops records below warn unless the
// handler it wraps logs debug.
type quietInfo struct{ slog.Handler }

func (q quietInfo) Enabled(ctx context.Context, level slog.Level) bool {
	if level < slog.LevelWarn && !q.Handler.Enabled(ctx, slog.LevelDebug) {
		return false
	}
	return q.Handler.Enabled(ctx, level)
}

func (q quietInfo) WithAttrs(attrs []slog.Attr) slog.Handler {
	return quietInfo{q.Handler.WithAttrs(attrs)}
}
func (q quietInfo) WithGroup(name string) slog.Handler { return quietInfo{q.Handler.WithGroup(name)} }
