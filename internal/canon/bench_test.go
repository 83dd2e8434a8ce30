package canon_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/corpus"
)

// BenchmarkTransform measures validation + canonicalization of real-world
// documents: canada.json (number-heavy) and citm_catalog.json (object- and
// string-heavy). Throughput is reported per input byte.
func BenchmarkTransform(b *testing.B) {
	for _, name := range []string{"canada.json", "citm_catalog.json"} {
		files := corpus.Files(b, filepath.Join("realworld", name), 1)
		doc, err := os.ReadFile(files[0])
		if err != nil {
			b.Fatal(err)
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(doc)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := canon.Transform(doc); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

var sinkHex string

// BenchmarkSHA256Hex1KiB measures the fingerprint of a 1 KiB document (the
// hash every *_sha256 column and header carries).
func BenchmarkSHA256Hex1KiB(b *testing.B) {
	doc := bytes.Repeat([]byte(`{"k":"v"},`), 103)[:1024]
	b.SetBytes(int64(len(doc)))
	b.ReportAllocs()
	var h string
	for b.Loop() {
		h = canon.SHA256Hex(doc)
	}
	sinkHex = h
}
