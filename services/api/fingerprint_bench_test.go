package api

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/docgen"
	"github.com/converge-run/converge/services/api/idempotency"
)

var sinkFingerprint string

// BenchmarkFingerprint measures the request fingerprint (seed 3): the
// canonical JSON of {operation, input_sha256, output_format, policy_version}
// and its SHA-256, computed once per create request.
func BenchmarkFingerprint(b *testing.B) {
	sha := canon.SHA256Hex([]byte(`{"a":1}`))
	b.ReportAllocs()
	for b.Loop() {
		sinkFingerprint = Fingerprint(sha, "jcs")
	}
}

// BenchmarkCreateCPU measures the CPU work of one create request outside
// SQL and HTTP, for the 1 KiB document loadgen and make bench send: parse
// the envelope, canonicalize the document, fingerprint, build the task, its
// TaskCreated event and the 202 body.
func BenchmarkCreateCPU(b *testing.B) {
	doc := docgen.Document(1, 1024)
	body := append(append([]byte(`{"output_format":"jcs","document":`), doc...), '}')
	now := time.Now().UTC()
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		req, err := parseCreateRequest(body)
		if err != nil {
			b.Fatal(err)
		}
		c, err := canon.Transform(req.Document)
		if err != nil {
			b.Fatal(err)
		}
		sha := canon.SHA256Hex(c)
		sinkFingerprint = Fingerprint(sha, req.OutputFormat)
		d, err := newTaskDraft("", req, c, sha)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := d.build(now); err != nil {
			b.Fatal(err)
		}
	}
}

// genericCanonical is the reference: encoding/json, then RFC 8785 by
// canon.Transform.
func genericCanonical(t *testing.T, v any) []byte {
	t.Helper()
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	c, err := canon.Transform(raw)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestFingerprintIsCanonical(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ sha, format string }{
		{canon.SHA256Hex([]byte(`{"a":1}`)), "jcs"},
		{"", ""},
		{"quote\"\\ctl\x01", "ü€😀\u2028"},
	} {
		want := canon.SHA256Hex(genericCanonical(t, map[string]any{
			"operation": fingerprintOperation, "input_sha256": tc.sha, "output_format": tc.format, "policy_version": PolicyVersion,
		}))
		if got := Fingerprint(tc.sha, tc.format); got != want {
			t.Errorf("Fingerprint(%q, %q) = %s, want %s", tc.sha, tc.format, got, want)
		}
	}
}

// createResponse is the 202 body of POST /v1/tasks as schemas/openapi.yaml
// describes it (TaskAccepted): the shape idempotency.AppendCreateResponse
// writes directly.
type createResponse struct {
	TaskID       string `json:"task_id"`
	Status       string `json:"status"`
	Version      int64  `json:"version"`
	InputSHA256  string `json:"input_sha256"`
	OutputFormat string `json:"output_format"`
	Links        links  `json:"links"`
}

func TestCreateResponseIsCanonical(t *testing.T) {
	t.Parallel()
	for _, r := range []createResponse{
		{TaskID: "018f3a2b-7c1d-7e00-8000-000000000000", Status: "queued", InputSHA256: strings.Repeat("ab", 32), OutputFormat: "jcs", Links: taskLinks("018f3a2b-7c1d-7e00-8000-000000000000")},
		{TaskID: "x\"<>&\u2028", Status: "ü", Version: 1<<53 - 1, OutputFormat: "\x01", Links: taskLinks("x\"<>&\u2028")},
	} {
		want := genericCanonical(t, r)
		if got := idempotency.AppendCreateResponse(nil, r.TaskID, r.Status, r.Version, r.InputSHA256, r.OutputFormat); !bytes.Equal(got, want) {
			t.Errorf("AppendCreateResponse:\n got  %s\n want %s", got, want)
		}
	}
}
