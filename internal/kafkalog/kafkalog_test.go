package kafkalog

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestLevels(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		level     slog.Level
		want      kgo.LogLevel
		infoShown bool
	}{
		{slog.LevelDebug, kgo.LogLevelDebug, true},
		{slog.LevelInfo, kgo.LogLevelWarn, false},
		{slog.LevelWarn, kgo.LogLevelWarn, false},
		{slog.LevelError, kgo.LogLevelError, false},
	} {
		var buf bytes.Buffer
		l := New(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: tc.level})))
		if got := l.Level(); got != tc.want {
			t.Errorf("logger at %s: Level() = %v, want %v", tc.level, got, tc.want)
		}
		l.Log(kgo.LogLevelInfo, "joined group", "group", "g")
		if shown := strings.Contains(buf.String(), "joined group"); shown != tc.infoShown {
			t.Errorf("logger at %s: info shown = %v, want %v", tc.level, shown, tc.infoShown)
		}
	}
}
