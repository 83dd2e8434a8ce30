package taskevent_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/taskevent"
)

func ptr[T any](v T) *T { return &v }

var (
	t0 = time.Date(2025, 3, 14, 15, 9, 26, 535897000, time.UTC)
	t1 = t0.Add(1500 * time.Millisecond)
)

// events returns one event of each type, as the outbox writes them.
func events() map[string]*taskevent.Event {
	created := &taskevent.Event{
		EventID:       "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
		EventType:     taskevent.TypeTaskCreated,
		SchemaVersion: taskevent.SchemaVersion,
		TaskID:        "task-1",
		TaskVersion:   0,
		OccurredAt:    t0,
		Task: taskevent.Task{
			TaskID:       "task-1",
			Status:       taskevent.StatusQueued,
			Version:      0,
			Attempt:      0,
			OutputFormat: "jcs",
			InputSHA256:  strings.Repeat("ab", 32),
			InputSize:    1234,
			CreatedAt:    t0,
			UpdatedAt:    t0,
		},
	}
	completed := &taskevent.Event{
		EventID:       "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c",
		EventType:     taskevent.TypeTaskCompleted,
		SchemaVersion: taskevent.SchemaVersion,
		TaskID:        "task-2",
		TaskVersion:   2,
		OccurredAt:    t1,
		Task: taskevent.Task{
			TaskID:         "task-2",
			Status:         taskevent.StatusCompleted,
			Version:        2,
			Attempt:        1,
			OutputFormat:   "jcs",
			InputSHA256:    strings.Repeat("01", 32),
			InputSize:      9007199254740991, // 2^53-1: the largest exact value
			ArtifactSHA256: ptr(strings.Repeat("fe", 32)),
			ArtifactSize:   ptr(int64(77)),
			CreatedAt:      t0,
			UpdatedAt:      t1,
			CompletedAt:    ptr(t1),
		},
	}
	failed := &taskevent.Event{
		EventID:       "evt-<&>-\u2028-é", // characters JSON encoders escape differently
		EventType:     taskevent.TypeTaskFailed,
		SchemaVersion: taskevent.SchemaVersion,
		TaskID:        "task-3",
		TaskVersion:   3,
		OccurredAt:    t1,
		Task: taskevent.Task{
			TaskID:            "task-3",
			Status:            taskevent.StatusFailed,
			Version:           3,
			Attempt:           3,
			OutputFormat:      "jcs",
			InputSHA256:       strings.Repeat("cd", 32),
			InputSize:         0,
			TerminalErrorCode: ptr("NUMBER_PRECISION_LOSS"),
			CreatedAt:         t0,
			UpdatedAt:         t1,
			CompletedAt:       ptr(t1),
		},
	}
	return map[string]*taskevent.Event{"created": created, "completed": completed, "failed": failed}
}

func mustEncode(t testing.TB, e *taskevent.Event) ([]byte, string) {
	t.Helper()
	out, sum, err := taskevent.Encode(e)
	if err != nil {
		t.Fatalf("Encode: %v", err)
	}
	return out, sum
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	t.Parallel()
	for name, e := range events() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			out, _ := mustEncode(t, e)
			got, err := taskevent.Decode(out)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !reflect.DeepEqual(got, e) {
				t.Errorf("round trip:\n got %+v\nwant %+v", got, e)
			}
		})
	}
}

var hexRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

func TestEncodeIsCanonical(t *testing.T) {
	t.Parallel()
	for name, e := range events() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			out, sum := mustEncode(t, e)
			again, err := canon.Transform(out)
			if err != nil {
				t.Fatalf("Transform: %v", err)
			}
			if !bytes.Equal(again, out) {
				t.Errorf("not canonical:\n got %s\nre-canonicalized %s", out, again)
			}
			if sum != canon.SHA256Hex(out) {
				t.Errorf("sha = %s, want SHA256Hex(out) = %s", sum, canon.SHA256Hex(out))
			}
			if !hexRE.MatchString(sum) {
				t.Errorf("sha %q is not 64 lowercase hex digits", sum)
			}
			// Canonical JSON has no insignificant whitespace and no HTML escapes.
			if bytes.Contains(out, []byte("\n")) || bytes.Contains(out, []byte(`\u003c`)) {
				t.Errorf("unexpected bytes in %s", out)
			}
			// Stable: encoding twice gives the same bytes.
			out2, sum2 := mustEncode(t, e)
			if !bytes.Equal(out2, out) || sum2 != sum {
				t.Error("Encode is not deterministic")
			}
		})
	}
}

func TestEncodeFieldNames(t *testing.T) {
	t.Parallel()
	out, _ := mustEncode(t, events()["created"])
	// The contract's member names (docs/events.md), nulls included.
	for _, member := range []string{
		`"event_id":`, `"event_type":"TaskCreated"`, `"schema_version":1`, `"task_id":"task-1"`,
		`"task_version":0`, `"occurred_at":"2025-03-14T15:09:26.535897Z"`, `"task":{`,
		`"artifact_sha256":null`, `"artifact_size":null`, `"terminal_error_code":null`, `"completed_at":null`,
	} {
		if !bytes.Contains(out, []byte(member)) {
			t.Errorf("%s missing from %s", member, out)
		}
	}
}

func TestEncodeError(t *testing.T) {
	t.Parallel()
	e := events()["created"]
	e.OccurredAt = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) // RFC 3339 cannot hold it
	if _, _, err := taskevent.Encode(e); err == nil || !strings.Contains(err.Error(), "TaskCreated") {
		t.Errorf("Encode: err = %v, want an error naming the event type", err)
	}
	e = events()["created"]
	e.Task.InputSize = 1<<53 + 1 // beyond what a double holds: canon refuses it
	if _, _, err := taskevent.Encode(e); err == nil {
		t.Error("Encode of a size above 2^53: want error")
	}
}

// jsonbText renders v the way PostgreSQL prints a jsonb value: object keys
// ordered by length, then bytes; ", " and ": " separators; numbers as given.
func jsonbText(v any) string {
	var b strings.Builder
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			keys := make([]string, 0, len(v))
			for k := range v {
				keys = append(keys, k)
			}
			slices.SortFunc(keys, func(a, b string) int {
				if len(a) != len(b) {
					return len(a) - len(b)
				}
				return strings.Compare(a, b)
			})
			b.WriteByte('{')
			for i, k := range keys {
				if i > 0 {
					b.WriteString(", ")
				}
				kb, _ := json.Marshal(k)
				b.Write(kb)
				b.WriteString(": ")
				walk(v[k])
			}
			b.WriteByte('}')
		case []any:
			b.WriteByte('[')
			for i, x := range v {
				if i > 0 {
					b.WriteString(", ")
				}
				walk(x)
			}
			b.WriteByte(']')
		case json.Number:
			b.WriteString(v.String())
		default:
			xb, _ := json.Marshal(v) // escapes <, >, & and U+2028 as \uXXXX
			b.Write(xb)
		}
	}
	walk(v)
	return b.String()
}

func TestCanonicalOfReserializedPayload(t *testing.T) {
	t.Parallel()
	for name, e := range events() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			want, wantSum := mustEncode(t, e)

			dec := json.NewDecoder(bytes.NewReader(want))
			dec.UseNumber()
			var tree any
			if err := dec.Decode(&tree); err != nil {
				t.Fatal(err)
			}
			indented, err := json.MarshalIndent(tree, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			marshalled, err := json.Marshal(e) // struct order, HTML-escaped
			if err != nil {
				t.Fatal(err)
			}
			variants := map[string][]byte{
				"jsonb text":        []byte(jsonbText(tree)),
				"indented":          indented,
				"encoding/json":     marshalled,
				"padded":            append(append([]byte(" \n\t"), want...), "\r\n "...),
				"already canonical": want,
			}
			for vname, payload := range variants {
				got, sum, err := taskevent.Canonical(payload)
				if err != nil {
					t.Errorf("%s: Canonical: %v", vname, err)
					continue
				}
				if !bytes.Equal(got, want) || sum != wantSum {
					t.Errorf("%s: Canonical(%s)\n = %s (%s)\nwant %s (%s)", vname, payload, got, sum, want, wantSum)
				}
			}
		})
	}
}

func TestCanonicalRejects(t *testing.T) {
	t.Parallel()
	for _, in := range []string{``, `{`, `{"a":1,"a":2}`, `{"n":12345678901234567890}`, "\"\xff\""} {
		_, _, err := taskevent.Canonical([]byte(in))
		var cerr *canon.Error
		if !errors.As(err, &cerr) {
			t.Errorf("Canonical(%q): err = %v, want a *canon.Error", in, err)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	t.Parallel()
	valid, _ := mustEncode(t, events()["completed"])
	// edit returns the valid event with one change applied to its JSON tree.
	edit := func(f func(m map[string]any)) []byte {
		var m map[string]any
		if err := json.Unmarshal(valid, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	task := func(m map[string]any) map[string]any { return m["task"].(map[string]any) }
	tests := []struct {
		name  string
		value []byte
		want  string // substring of the error
	}{
		{"empty", nil, ""},
		{"not JSON", []byte("not json"), ""},
		{"truncated", valid[:len(valid)-1], ""},
		{"array", []byte(`[]`), ""},
		{"wrong type", edit(func(m map[string]any) { m["task_version"] = "2" }), ""},
		{"missing event_id", edit(func(m map[string]any) { delete(m, "event_id") }), "event_id"},
		{"empty event_id", edit(func(m map[string]any) { m["event_id"] = "" }), "event_id"},
		{"missing task_id", edit(func(m map[string]any) { delete(m, "task_id") }), "task_id"},
		{"missing task", edit(func(m map[string]any) { delete(m, "task") }), "task_id"},
		{"task_id mismatch", edit(func(m map[string]any) { task(m)["task_id"] = "task-other" }), "task_id"},
		{"both task_ids empty", edit(func(m map[string]any) { m["task_id"] = ""; task(m)["task_id"] = "" }), "task_id"},
		{"schema_version 0", edit(func(m map[string]any) { m["schema_version"] = 0 }), "schema_version"},
		{"schema_version 2", edit(func(m map[string]any) { m["schema_version"] = 2 }), "schema_version"},
		{"schema_version missing", edit(func(m map[string]any) { delete(m, "schema_version") }), "schema_version"},
		{"task_version ahead", edit(func(m map[string]any) { m["task_version"] = 3 }), "task_version"},
		{"task.version ahead", edit(func(m map[string]any) { task(m)["version"] = 3 }), "task_version"},
		{"negative version", edit(func(m map[string]any) { m["task_version"] = -1; task(m)["version"] = -1 }), "task_version"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e, err := taskevent.Decode(tt.value)
			if !errors.Is(err, taskevent.ErrInvalidEvent) {
				t.Fatalf("Decode(%s): err = %v, want ErrInvalidEvent", tt.value, err)
			}
			if e != nil {
				t.Errorf("Decode returned an event with the error")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not mention %q", err, tt.want)
			}
		})
	}
	// The unedited event decodes: the cases above fail for their edit only.
	if _, err := taskevent.Decode(edit(func(map[string]any) {})); err != nil {
		t.Fatalf("valid event: %v", err)
	}
}

func TestDecodeIgnoresUnknownMembers(t *testing.T) {
	t.Parallel()
	// A minor, additive schema change must not break old consumers.
	v := []byte(`{"event_id":"e","event_type":"TaskCreated","schema_version":1,"task_id":"t","task_version":0,` +
		`"occurred_at":"2025-01-01T00:00:00Z","new_member":[1],"task":{"task_id":"t","version":0,"status":"queued","extra":{}}}`)
	e, err := taskevent.Decode(v)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if e.EventID != "e" || e.Task.Status != taskevent.StatusQueued || !e.OccurredAt.Equal(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("Decode = %+v", e)
	}
}

func TestHeaders(t *testing.T) {
	t.Parallel()
	sum := strings.Repeat("0f", 32)
	got := taskevent.Headers("evt-1", taskevent.TypeTaskCompleted, 9007199254740991, sum, "tenant-1")
	want := [taskevent.NumHeaders][2]string{
		{"event-id", "evt-1"},
		{"event-type", "TaskCompleted"},
		{"aggregate-version", "9007199254740991"},
		{"payload-sha256", sum},
		{"content-type", "application/json"},
		{"tenant-id", "tenant-1"},
	}
	if got != want {
		t.Errorf("Headers =\n%v\nwant\n%v", got, want)
	}
	// The names are the exported constants, in that order.
	names := []string{taskevent.HeaderEventID, taskevent.HeaderEventType, taskevent.HeaderAggregateVersion,
		taskevent.HeaderPayloadSHA256, taskevent.HeaderContentType, taskevent.HeaderTenantID}
	for i, h := range got {
		if h[0] != names[i] {
			t.Errorf("header %d = %s, want %s", i, h[0], names[i])
		}
	}
	if v := taskevent.Headers("e", "t", 0, "", "")[2][1]; v != "0" {
		t.Errorf("aggregate-version of 0 = %q", v)
	}
}

func TestHeadersMatchEncode(t *testing.T) {
	t.Parallel()
	e := events()["completed"]
	out, sum := mustEncode(t, e)
	h := taskevent.Headers(e.EventID, e.EventType, e.TaskVersion, sum, e.Task.TenantID)
	if h[3][1] != canon.SHA256Hex(out) {
		t.Errorf("payload-sha256 header %s does not hash the value", h[3][1])
	}
	if h[2][1] != fmt.Sprint(e.Task.Version) {
		t.Errorf("aggregate-version %s, task version %d", h[2][1], e.Task.Version)
	}
}

func TestTerminal(t *testing.T) {
	t.Parallel()
	tests := []struct {
		status string
		want   bool
	}{
		{taskevent.StatusQueued, false},
		{taskevent.StatusRunning, false},
		{taskevent.StatusCompleted, true},
		{taskevent.StatusFailed, true},
		{taskevent.StatusCompensating, false},
		{taskevent.StatusCompensated, true},
		{"", false},
		{"COMPLETED", false},
		{"rejected", false},
	}
	for _, tt := range tests {
		if got := taskevent.Terminal(tt.status); got != tt.want {
			t.Errorf("Terminal(%q) = %v, want %v", tt.status, got, tt.want)
		}
	}
}

func BenchmarkEncode(b *testing.B) {
	e := events()["completed"]
	out, _ := mustEncode(b, e)
	b.SetBytes(int64(len(out)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := taskevent.Encode(e); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCanonicalPayload is the relay's per-record work: outbox payload
// text (jsonb) to record value and hash.
func BenchmarkCanonicalPayload(b *testing.B) {
	out, _ := mustEncode(b, events()["completed"])
	dec := json.NewDecoder(bytes.NewReader(out))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		b.Fatal(err)
	}
	payload := []byte(jsonbText(tree))
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := taskevent.Canonical(payload); err != nil {
			b.Fatal(err)
		}
	}
}
