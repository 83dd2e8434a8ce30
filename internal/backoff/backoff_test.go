package backoff

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestDelay(t *testing.T) {
	t.Parallel()
	for n, want := range []time.Duration{100, 200, 400, 800, 1000, 1000} {
		want *= time.Millisecond
		for range 50 {
			if d := Delay(100*time.Millisecond, time.Second, n); d < want/2 || d > want {
				t.Fatalf("Delay(n=%d) = %s, want in [%s, %s]", n, d, want/2, want)
			}
		}
	}
	if d := Delay(time.Millisecond, time.Hour, 200); d < 30*time.Minute || d > time.Hour {
		t.Fatalf("Delay of a huge n = %s, want capped at max", d)
	}
	if d := Delay(0, time.Second, 3); d != 0 {
		t.Fatalf("Delay with min 0 = %s", d)
	}
}

func TestSleepStopsWithContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Sleep(ctx, time.Hour, time.Hour, 0) {
		t.Fatal("Sleep returned true after ctx ended")
	}
	if !Sleep(context.Background(), time.Millisecond, time.Millisecond, 0) {
		t.Fatal("Sleep returned false")
	}
}

// The worker's attempts (moved with the function from consumers/worker).
func TestDelayAttempts(t *testing.T) {
	t.Parallel()
	min, max := 10*time.Millisecond, time.Second
	for n := 0; n < 100; n++ {
		d := Delay(min, max, n)
		ceil := max
		if n < 7 {
			ceil = min << n
		}
		if d < ceil/2 || d > ceil {
			t.Fatalf("attempt %d: backoff %s outside [%s, %s]", n, d, ceil/2, ceil)
		}
	}
}
