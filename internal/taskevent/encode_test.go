package taskevent

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/canon"
)

// randomEvent draws an event whose strings include escapes, non-ASCII,
// U+2028, invalid UTF-8 now and then, integers up to and beyond 2^53, and
// times in several zones with and without fractional seconds.
func randomEvent(r *rand.Rand) *Event {
	strs := []string{"", "a", "TaskCreated", "quote\"back\\slash", "ctl\x00\x01\x1f\t\n\r\b\f", "ü€😀", "\u2028\u2029", "</script>&", "bad\xffutf8", "018f3a2b-7c1d-7e00-8000-000000000000"}
	s := func() string { return strs[r.IntN(len(strs))] }
	ints := []int64{0, 1, -1, 42, 1<<53 - 1, -(1<<53 - 1), 1 << 53, -(1 << 53), 1<<63 - 1}
	i := func() int64 {
		if r.IntN(4) == 0 {
			return ints[r.IntN(len(ints))]
		}
		return r.Int64N(1 << 40)
	}
	zones := []*time.Location{time.UTC, time.FixedZone("p", 2*3600+30*60), time.FixedZone("m", -7*3600), time.FixedZone("s", 3600+17), time.FixedZone("big", 25*3600)}
	tm := func() time.Time {
		t := time.Unix(r.Int64N(4_000_000_000), 0)
		switch r.IntN(4) {
		case 1:
			t = t.Add(time.Duration(r.IntN(1_000_000)) * time.Microsecond)
		case 2:
			t = t.Add(time.Duration(r.IntN(1_000_000_000)))
		}
		if r.IntN(20) == 0 {
			t = time.Date(10000+r.IntN(10), 1, 1, 0, 0, 0, 0, time.UTC)
		}
		return t.In(zones[r.IntN(len(zones))])
	}
	optS := func() *string {
		if r.IntN(2) == 0 {
			return nil
		}
		v := s()
		return &v
	}
	e := &Event{EventID: s(), EventType: s(), SchemaVersion: int(i()), TaskID: s(), TaskVersion: i(), OccurredAt: tm()}
	e.Task = Task{TaskID: s(), TenantID: s(), Status: s(), Version: i(), Attempt: int(i()), OutputFormat: s(), InputSHA256: s(), InputSize: i(),
		ArtifactSHA256: optS(), TerminalErrorCode: optS(), CreatedAt: tm(), UpdatedAt: tm()}
	if r.IntN(2) == 0 {
		v := i()
		e.Task.ArtifactSize = &v
	}
	if r.IntN(2) == 0 {
		v := tm()
		e.Task.CompletedAt = &v
	}
	return e
}

// TestEncodeFastPathMatchesGeneric: Encode gives byte for byte what the
// generic encoder (encoding/json, then RFC 8785 by canon.Transform) gives,
// or fails where it fails.
func TestEncodeFastPathMatchesGeneric(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	fast := 0
	for n := range 20000 {
		e := randomEvent(r)
		got, gotSum, gotErr := Encode(e)
		want, wantSum, wantErr := encodeGeneric(e)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("event %d: Encode err = %v, generic err = %v", n, gotErr, wantErr)
		}
		if gotErr != nil {
			continue
		}
		if !bytes.Equal(got, want) || gotSum != wantSum {
			t.Fatalf("event %d:\n fast    %s\n generic %s", n, got, want)
		}
		if _, ok := appendCanonical(nil, e); ok {
			fast++
		}
	}
	if fast < 500 {
		t.Errorf("only %d of 20000 events took the fast path", fast)
	}
}

func TestEncodeFastPathRefuses(t *testing.T) {
	t.Parallel()
	base := func() *Event {
		now := time.Date(2026, 11, 30, 12, 0, 0, 123456000, time.UTC)
		return &Event{EventID: "e", EventType: TypeTaskCreated, SchemaVersion: 1, TaskID: "t", OccurredAt: now,
			Task: Task{TaskID: "t", Status: StatusQueued, OutputFormat: "jcs", CreatedAt: now, UpdatedAt: now}}
	}
	if _, ok := appendCanonical(nil, base()); !ok {
		t.Fatal("a plain event must take the fast path")
	}
	for name, mutate := range map[string]func(*Event){
		"size above 2^53":   func(e *Event) { e.Task.InputSize = 1<<53 + 1 },
		"invalid UTF-8":     func(e *Event) { e.Task.Status = "\xff" },
		"year 10000":        func(e *Event) { e.Task.UpdatedAt = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) },
		"offset of 25 h":    func(e *Event) { e.OccurredAt = e.OccurredAt.In(time.FixedZone("x", 25*3600)) },
		"offset with secs":  func(e *Event) { e.OccurredAt = e.OccurredAt.In(time.FixedZone("x", 61)) },
		"artifact size big": func(e *Event) { v := int64(-(1 << 53)); e.Task.ArtifactSize = &v },
	} {
		e := base()
		mutate(e)
		if out, ok := appendCanonical(nil, e); ok {
			t.Errorf("%s: fast path took it: %s", name, out)
		}
		if name == "size above 2^53" || name == "year 10000" { // the generic path refuses them too
			if _, _, err := Encode(e); err == nil {
				t.Errorf("%s: Encode: want error", name)
			}
		}
	}
}

func BenchmarkEncodePaths(b *testing.B) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 123456000, time.UTC)
	sha := strings.Repeat("ab", 32)
	e := &Event{EventID: "018f3a2b-7c1d-7e00-8000-000000000001", EventType: TypeTaskCreated, SchemaVersion: 1,
		TaskID: "018f3a2b-7c1d-7e00-8000-000000000000", OccurredAt: now,
		Task: Task{TaskID: "018f3a2b-7c1d-7e00-8000-000000000000", Status: StatusQueued, OutputFormat: "jcs",
			InputSHA256: sha, InputSize: 1024, CreatedAt: now, UpdatedAt: now}}
	b.Run("fast", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := Encode(e); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("generic", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := encodeGeneric(e); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkTaskView: the Redis task view's encoding (taskview's
// Cache.encode), by AppendTask and by encoding/json (before).
func BenchmarkTaskView(b *testing.B) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 123456000, time.UTC)
	sha := strings.Repeat("ab", 32)
	size := int64(1100)
	task := Task{TaskID: "018f3a2b-7c1d-7e00-8000-000000000000", TenantID: "bench-1", Status: StatusCompleted, Version: 2,
		Attempt: 1, OutputFormat: "jcs", InputSHA256: sha, InputSize: 1024, ArtifactSHA256: &sha, ArtifactSize: &size,
		CreatedAt: now, UpdatedAt: now, CompletedAt: &now}
	b.Run("AppendTask", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := AppendTask(make([]byte, 0, 512), &task); !ok {
				b.Fatal("not taken")
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := json.Marshal(task); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestDecodeIsStrict: a duplicated member or a member name in another case
// is an invalid event (I-JSON, RFC 7493), not silently merged.
func TestDecodeIsStrict(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	good, _, err := Encode(&Event{EventID: "e", EventType: TypeTaskCreated, SchemaVersion: 1, TaskID: "t", OccurredAt: now,
		Task: Task{TaskID: "t", Status: StatusQueued, OutputFormat: "jcs", CreatedAt: now, UpdatedAt: now}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Decode(good); err != nil {
		t.Fatalf("Decode(%s): %v", good, err)
	}
	for name, value := range map[string]string{
		"duplicate member": strings.Replace(string(good), `{"event_id":"e"`, `{"event_id":"e","event_id":"f"`, 1),
		"other case":       strings.Replace(string(good), `"event_id"`, `"Event_ID"`, 1),
		"invalid UTF-8":    strings.Replace(string(good), `"status":"queued"`, "\"status\":\"q\xffd\"", 1),
	} {
		if _, err := Decode([]byte(value)); !errors.Is(err, ErrInvalidEvent) {
			t.Errorf("%s: Decode err = %v, want ErrInvalidEvent", name, err)
		}
	}
}

// TestAppendTaskMatchesEncodingJSON: the task view's fast encoding decodes
// to the task encoding/json encodes, and is its RFC 8785 form, for every
// random task it takes (the Redis view is json.Unmarshal'ed by Cache.Get).
func TestAppendTaskMatchesEncodingJSON(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	fast := 0
	for n := range 20000 {
		task := randomEvent(r).Task
		got, ok := AppendTask(nil, &task)
		if !ok {
			continue
		}
		fast++
		want, err := json.Marshal(task)
		if err != nil {
			t.Fatalf("task %d: the fast path took a task encoding/json refuses: %v", n, err)
		}
		canonical, err := canon.Transform(want)
		if err != nil {
			t.Fatalf("task %d: %v", n, err)
		}
		if !bytes.Equal(got, canonical) {
			t.Fatalf("task %d:\n fast         %s\n encoding/json %s (canonical %s)", n, got, want, canonical)
		}
		var back Task
		if err := json.Unmarshal(got, &back); err != nil || !reflect.DeepEqual(back, roundTrip(t, task)) {
			t.Fatalf("task %d: %s decodes to %+v (%v)", n, got, back, err)
		}
	}
	if fast < 500 {
		t.Errorf("only %d of 20000 tasks took the fast path", fast)
	}
}

// roundTrip is task through encoding/json and back (times lose their
// monotonic reading and location pointer identity there).
func roundTrip(t *testing.T, task Task) Task {
	t.Helper()
	raw, err := json.Marshal(task)
	if err != nil {
		t.Fatal(err)
	}
	var back Task
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	return back
}
