package api

import (
	"testing"
	"time"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/loadgen"
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
	doc := loadgen.GenerateDocument(1, 1024)
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
		if _, err := buildTask(now, req, sha, int64(len(c))); err != nil {
			b.Fatal(err)
		}
	}
}
