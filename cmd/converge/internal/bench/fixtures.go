package bench

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"strings"
	"time"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/docgen"
	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/services/api"
)

// Placeholders of the event template; real ids replace them.
const (
	phTask   = "00000000-0000-7000-8000-00000000beef"
	phOutbox = "00000000-0000-7000-8000-00000000cafe"
)

// fixtures are rows shaped and sized like the ones the API and the worker
// write for a generated document of Config.DocSize bytes.
type fixtures struct {
	doc         []byte // the document as stored in task_input
	inputSHA    string
	inputSize   int64
	fingerprint string
	created     []byte // TaskCreated payload template (canonical JSON)
	completed   []byte // TaskCompleted payload template
	response    []byte // the 202 body as stored in idempotency_record
	tenantID    string // the tenant of the create stage's pgbench rows
}

func newFixtures(docSize int) *fixtures {
	f := &fixtures{doc: docgen.Document(0, docSize)}
	c, err := canon.Transform(f.doc)
	if err != nil {
		panic(err) // a generated document is valid I-JSON
	}
	f.inputSHA, f.inputSize = canon.SHA256Hex(c), int64(len(c))
	f.fingerprint = api.Fingerprint(f.inputSHA, "jcs")
	now := time.Date(2026, 1, 2, 3, 4, 5, 678901000, time.UTC)
	t := taskevent.Task{TaskID: phTask, Status: taskevent.StatusQueued, OutputFormat: "jcs", InputSHA256: f.inputSHA,
		InputSize: f.inputSize, CreatedAt: now, UpdatedAt: now}
	f.created, _, err = taskevent.Encode(&taskevent.Event{EventID: phOutbox, EventType: taskevent.TypeTaskCreated,
		SchemaVersion: taskevent.SchemaVersion, TaskID: phTask, OccurredAt: now, Task: t})
	if err != nil {
		panic(err)
	}
	sha, size := f.inputSHA, f.inputSize
	t.Status, t.Version, t.Attempt, t.ArtifactSHA256, t.ArtifactSize, t.CompletedAt = taskevent.StatusCompleted, 2, 1, &sha, &size, &now
	f.completed, _, err = taskevent.Encode(&taskevent.Event{EventID: phOutbox, EventType: taskevent.TypeTaskCompleted,
		SchemaVersion: taskevent.SchemaVersion, TaskID: phTask, TaskVersion: 2, OccurredAt: now, Task: t})
	if err != nil {
		panic(err)
	}
	resp, _ := json.Marshal(map[string]any{"task_id": phTask, "status": "queued", "version": 0, "input_sha256": f.inputSHA,
		"output_format": "jcs", "links": map[string]string{"self": "/v1/tasks/" + phTask, "artifact": "/v1/tasks/" + phTask + "/artifact"}})
	f.response, _ = canon.Transform(resp)
	return f
}

// event returns the TaskCreated payload of task taskID with event id
// outboxID and its SHA-256: what the API writes to outbox_event.
func (f *fixtures) event(taskID, outboxID string) ([]byte, string) {
	p := bytes.ReplaceAll(f.created, []byte(phTask), []byte(taskID))
	p = bytes.ReplaceAll(p, []byte(phOutbox), []byte(outboxID))
	return p, canon.SHA256Hex(p)
}

// sqlText returns an escape-string literal of s in which no colon appears
// (pgbench would take ":name" inside a literal for a variable).
func sqlText(s string) string {
	s = strings.ReplaceAll(s, `\`, `\\`)
	s = strings.ReplaceAll(s, "'", "''")
	return "E'" + strings.ReplaceAll(s, ":", `\x3a`) + "'"
}

// sqlBytea returns a bytea literal of b in hex form.
func sqlBytea(b []byte) string { return `'\x` + hex.EncodeToString(b) + `'` }
