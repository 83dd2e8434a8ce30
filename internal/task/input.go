package task

import "github.com/converge-run/converge/internal/canon"

// CanonicalInput returns the RFC 8785 form of doc, a task's stored input
// (task_input.document), and its SHA-256 in lowercase hex: the artifact of
// the task's conversion (output_format "jcs") and the hash its effect
// records.
//
// The API stores the canonical form of the submitted document, whose
// SHA-256 is the task's input_sha256 (seed 2.2, 3: inputSha256 =
// sha256(canonical(input))). When doc hashes to inputSHA256 it is returned as
// it is: canonicalization is idempotent, and the hash shows these are the
// bytes the API canonicalized, so canonicalizing them again gives them back
// (the worker's second canonicalization per task was 3 % of the converge
// process's CPU, BENCHMARKS.md, fourteenth session). Any other doc — an
// input stored before the API stored the canonical form (the document as
// received), or one changed since — is canonicalized by canon.Transform,
// whose *canon.Error refuses a document outside I-JSON.
func CanonicalInput(doc []byte, inputSHA256 string) ([]byte, string, error) {
	sha := canon.SHA256Hex(doc)
	if sha == inputSHA256 {
		return doc, sha, nil
	}
	out, err := canon.Transform(doc)
	if err != nil {
		return nil, "", err
	}
	return out, canon.SHA256Hex(out), nil
}
