package task

import (
	"errors"
	"testing"

	"github.com/converge-run/converge/internal/canon"
)

func TestCanonicalInput(t *testing.T) {
	t.Parallel()
	raw := []byte(`{ "b": [1, 2.50, "x"], "a": {"z": null, "y": 1e2} }`)
	want, err := canon.Transform(raw)
	if err != nil {
		t.Fatal(err)
	}
	wantSHA := canon.SHA256Hex(want)

	// What the API stores: the canonical form, whose hash is input_sha256.
	stored := append([]byte(nil), want...)
	out, sha, err := CanonicalInput(stored, wantSHA)
	if err != nil || string(out) != string(want) || sha != wantSHA || &out[0] != &stored[0] {
		t.Fatalf("canonical input: %q %s %v; want the stored bytes themselves, %s", out, sha, err, wantSHA)
	}

	// What an earlier release stored: the document as received.
	out, sha, err = CanonicalInput(raw, wantSHA)
	if err != nil || string(out) != string(want) || sha != wantSHA {
		t.Fatalf("input as received: %q %s %v; want %q %s", out, sha, err, want, wantSHA)
	}

	// Bytes that do not hash to input_sha256 are canonicalized, whatever
	// they are: a changed input gives its own hash, and one outside I-JSON
	// is refused with canon's error.
	out, sha, err = CanonicalInput([]byte(`{"c":1}`), wantSHA)
	if err != nil || string(out) != `{"c":1}` || sha != canon.SHA256Hex([]byte(`{"c":1}`)) {
		t.Fatalf("changed input: %q %s %v", out, sha, err)
	}
	var ce *canon.Error
	if _, _, err := CanonicalInput([]byte(`{"a":1,"a":2}`), wantSHA); !errors.As(err, &ce) || ce.Code != canon.CodeDuplicateMemberName {
		t.Fatalf("duplicate member: %v; want %s", err, canon.CodeDuplicateMemberName)
	}
}
