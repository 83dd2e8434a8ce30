package api

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/converge-run/converge/internal/artifact"
	"github.com/converge-run/converge/internal/canon"
)

// completeTask marks id completed with data as its verified artifact, the
// way the worker would: artifact written under the effect token, a verified
// effect row, the task completed at version 2.
func completeTask(t *testing.T, b *testBundle, id string, data []byte) string {
	t.Helper()
	ctx := context.Background()
	token := artifact.Token(id, 1)
	meta, err := b.artifacts.Put(token, id, 1, data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.db.Pool.Exec(ctx, `
INSERT INTO effect_ledger (effect_id, task_id, attempt, effect_kind, idempotency_token, target_identity, state, request_sha256, request_size, observed_result_sha256)
VALUES ($1, $2, 1, 'artifact.put', $1, $1, 'verified', $3, $4, $3)`, token, id, meta.SHA256, meta.Size); err != nil {
		t.Fatal(err)
	}
	tag, err := b.db.Pool.Exec(ctx, `
UPDATE task SET status='completed', version=2, attempt=1, artifact_sha256=$2, artifact_size=$3, completed_at=now(), updated_at=now()
WHERE task_id=$1 AND version=0`, id, meta.SHA256, meta.Size)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("complete task: %v %v", tag, err)
	}
	return token
}

func TestGetArtifact(t *testing.T) {
	t.Parallel()
	b := setup(t)
	doc := `{"b":2,"a":[1.0,"x"]}`
	id := b.post(t, "artifact-0001", wrap(doc)).json(t)["task_id"].(string)

	r := b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil)
	wantProblem(t, r, http.StatusConflict, CodeArtifactNotReady)
	if r.json(t)["task_status"] != "queued" {
		t.Fatalf("not ready problem %s", r.body)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/018f6b2e-0000-7000-8000-00000000abcd/artifact", nil, nil), http.StatusNotFound, CodeTaskNotFound)

	canonical, err := canon.Transform([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	token := completeTask(t, b, id, canonical)
	sum := sha256.Sum256(canonical)

	r = b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil)
	if r.status != http.StatusOK || string(r.body) != string(canonical) {
		t.Fatalf("artifact: %d %q", r.status, r.body)
	}
	for name, want := range map[string]string{
		"Content-Type":      "application/json",
		"Content-Length":    "",
		"ETag":              `"` + hex.EncodeToString(sum[:]) + `"`,
		"Repr-Digest":       "sha-256=:" + base64.StdEncoding.EncodeToString(sum[:]) + ":",
		"X-Artifact-Sha256": hex.EncodeToString(sum[:]),
	} {
		if got := r.header.Get(name); (want == "" && got == "") || (want != "" && got != want) {
			t.Errorf("%s = %q, want %q", name, got, want)
		}
	}
	head := b.do(t, http.MethodHead, "/v1/tasks/"+id+"/artifact", nil, nil)
	if head.status != http.StatusOK || len(head.body) != 0 || head.header.Get("X-Artifact-Sha256") != hex.EncodeToString(sum[:]) {
		t.Fatalf("HEAD: %d %v", head.status, head.header)
	}

	// Stored bytes that no longer match the verified hash are never served.
	// (The object is the only one of its pack file, whose record ends with
	// its bytes: changing the file's last byte alters them, not the header.)
	obj := filepath.Join(b.artifacts.Root(), "objects", token+".obj")
	stored, err := os.ReadFile(obj)
	if err != nil {
		t.Fatal(err)
	}
	stored[len(stored)-1] ^= 0x20
	if err := os.WriteFile(obj, stored, 0o644); err != nil {
		t.Fatal(err)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil), http.StatusServiceUnavailable, CodeArtifactUnavailable)
	// A hidden (compensated) object is unavailable too.
	if err := b.artifacts.Hide(token); err != nil {
		t.Fatal(err)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil), http.StatusServiceUnavailable, CodeArtifactUnavailable)
}

func TestGetArtifactOfFailedTask(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "artifact-failed", wrap(`[]`)).json(t)["task_id"].(string)
	if _, err := b.db.Pool.Exec(context.Background(),
		`UPDATE task SET status='failed', version=1, terminal_error_code='ARTIFACT_VERIFICATION_FAILED' WHERE task_id=$1 AND version=0`, id); err != nil {
		t.Fatal(err)
	}
	r := b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil)
	wantProblem(t, r, http.StatusConflict, CodeTaskFailed)
	if p := r.json(t); p["terminal_error_code"] != "ARTIFACT_VERIFICATION_FAILED" || p["task_status"] != "failed" {
		t.Fatalf("problem %v", p)
	}
}

func TestGetArtifactCompletedWithoutVerifiedEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.post(t, "artifact-noeffect", wrap(`[]`)).json(t)["task_id"].(string)
	if _, err := b.db.Pool.Exec(context.Background(), `
UPDATE task SET status='completed', version=2, artifact_sha256=$2, artifact_size=2, completed_at=now() WHERE task_id=$1 AND version=0`,
		id, canon.SHA256Hex([]byte(`[]`))); err != nil {
		t.Fatal(err)
	}
	wantProblem(t, b.do(t, http.MethodGet, "/v1/tasks/"+id+"/artifact", nil, nil), http.StatusServiceUnavailable, CodeArtifactUnavailable)
}
