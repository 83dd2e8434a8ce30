package canon_test

import (
	"bytes"
	"errors"
	"math"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/corpus"
)

// TestJCSVectors proves the transform against the RFC 8785 test vectors of the
// reference implementation (../shared/corpus/jcs): byte-for-byte.
func TestJCSVectors(t *testing.T) {
	t.Parallel()
	inputs := corpus.Files(t, "jcs/input/*.json", 1)
	for _, in := range inputs {
		t.Run(filepath.Base(in), func(t *testing.T) {
			doc := mustRead(t, in)
			want := mustRead(t, filepath.Join(filepath.Dir(in), "..", "output", filepath.Base(in)))
			got, err := canon.Transform(doc)
			if err != nil {
				t.Fatalf("Transform: %v", err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("got  %q\nwant %q", got, want)
			}
		})
	}
}

// TestJSONTestSuite checks every JSONTestSuite case: y_ cases that are I-JSON
// canonicalize to what an independent RFC 8785 implementation (gowebpki/jcs)
// produces; n_ cases are rejected with a syntax code; i_ cases either way,
// never a panic.
func TestJSONTestSuite(t *testing.T) {
	t.Parallel()
	files := corpus.Files(t, "jsontestsuite/*.json", 300)
	for _, f := range files {
		name := filepath.Base(f)
		doc := mustRead(t, f)
		got, err := canon.Transform(doc)
		var cerr *canon.Error
		if err != nil && !errors.As(err, &cerr) {
			t.Errorf("%s: error is %T, want *canon.Error", name, err)
			continue
		}
		switch {
		case strings.HasPrefix(name, "y_"):
			if code, bad := corpus.NotIJSON[name]; bad {
				if cerr == nil || cerr.Code != code {
					t.Errorf("%s: got %v, want %s", name, err, code)
				}
				continue
			}
			if err != nil {
				t.Errorf("%s: rejected: %v", name, err)
				continue
			}
			want, jerr := jcs.Transform(doc)
			if jerr != nil {
				t.Errorf("%s: independent implementation rejects it: %v", name, jerr)
				continue
			}
			if !bytes.Equal(got, want) {
				t.Errorf("%s: got %q, independent implementation %q", name, got, want)
			}
		case strings.HasPrefix(name, "n_"):
			if err == nil {
				t.Errorf("%s: accepted %q", name, got)
			}
		}
	}
}

func TestNumberPolicy(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want string // canonical form, or error code
	}{
		{"1", "1"},
		{"-0", "0"},
		{"1.0", "1"},
		{"1e23", "1e+23"},
		{"100000000000000000000000", "1e+23"},
		{"9007199254740992", "9007199254740992"},
		{"9007199254740993", canon.CodeNumberPrecisionLoss},
		{"12345678901234567", canon.CodeNumberPrecisionLoss},
		{"12345678901234567890", canon.CodeNumberPrecisionLoss},
		{"-65.613616999999977", "-65.61361699999998"},
		{"0.30000000000000001", "0.3"},
		{"0.10000000000000000000001", canon.CodeNumberPrecisionLoss},
		{"0.1000000000000000000000", "0.1"},
		{"1e400", canon.CodeNumberOutOfRange},
		{"-1e400", canon.CodeNumberOutOfRange},
		{"1e-400", canon.CodeNumberOutOfRange},
		{"0e-400", "0"},
		{"5e-324", "5e-324"},
		{"1.7976931348623157e308", "1.7976931348623157e+308"},
		// More significant digits than a canonical form has: refused
		// without the exact comparison, whatever the length.
		{"1." + strings.Repeat("3", 800), canon.CodeNumberPrecisionLoss},
		{"[1." + strings.Repeat("3", 1_000_000) + "]", canon.CodeNumberPrecisionLoss},
		{"1" + strings.Repeat("0", 30) + "1", canon.CodeNumberPrecisionLoss},
		{"1" + strings.Repeat("0", 30), "1e+30"},
		// Even the exact decimal form of a double (2^-1074: 751 significant
		// digits) changes: its canonical form is 5e-324.
		{exactSmallest(), canon.CodeNumberPrecisionLoss},
	}
	for _, tt := range tests {
		got, err := canon.Transform([]byte(tt.in))
		if err != nil {
			var cerr *canon.Error
			if !errors.As(err, &cerr) || cerr.Code != tt.want {
				t.Errorf("%s: error %v, want %s", tt.in, err, tt.want)
			}
			continue
		}
		if string(got) != tt.want {
			t.Errorf("%s: got %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestRejections(t *testing.T) {
	t.Parallel()
	tests := []struct{ in, code string }{
		{``, canon.CodeMalformedJSON},
		{`{"a":1`, canon.CodeMalformedJSON},
		{`{"a":1} {}`, canon.CodeMalformedJSON},
		{"\"\xff\"", canon.CodeInvalidUTF8},
		{`"\ud800"`, canon.CodeLoneSurrogate},
		{`{"a":1,"a":1}`, canon.CodeDuplicateMemberName},
		// Member names inside the library's message do not decide the code.
		{`{"exceeded max depth":tru}`, canon.CodeMalformedJSON},
		{`{"surrogate":tru}`, canon.CodeMalformedJSON},
		{`{"invalid UTF-8":tru}`, canon.CodeMalformedJSON},
		{`{"a":{"surrogate":[1,}}`, canon.CodeMalformedJSON},
		{strings.Repeat("[", canon.MaxDepth+1) + strings.Repeat("]", canon.MaxDepth+1), canon.CodeNestingTooDeep},
		// Unclosed is not JSON at all, however deep (issue 13): 400, not 422.
		{strings.Repeat("[", 100000), canon.CodeMalformedJSON},
		{strings.Repeat("[", 5000), canon.CodeMalformedJSON},
		{strings.Repeat(`{"a":[`, canon.MaxDepth) + `"]}"`, canon.CodeMalformedJSON}, // brackets inside a string do not close
		{strings.Repeat(`{"a":`, canon.MaxDepth+1) + `"x\"}"` + strings.Repeat("}", canon.MaxDepth+1), canon.CodeNestingTooDeep},
	}
	for _, tt := range tests {
		_, err := canon.Transform([]byte(tt.in))
		var cerr *canon.Error
		if !errors.As(err, &cerr) || cerr.Code != tt.code {
			t.Errorf("%.30q: error %v, want %s", tt.in, err, tt.code)
		}
	}
	if _, err := canon.Transform([]byte(strings.Repeat("[", canon.MaxDepth) + strings.Repeat("]", canon.MaxDepth))); err != nil {
		t.Errorf("depth %d rejected: %v", canon.MaxDepth, err)
	}
}

func TestRealWorld(t *testing.T) {
	t.Parallel()
	files := corpus.Files(t, "realworld/*.json", 20)
	for _, f := range files {
		doc := mustRead(t, f)
		got, err := canon.Transform(doc)
		if err != nil {
			t.Errorf("%s: %v", filepath.Base(f), err)
			continue
		}
		want, err := jcs.Transform(doc)
		if err != nil {
			t.Errorf("%s: independent implementation: %v", filepath.Base(f), err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s: differs from the independent implementation", filepath.Base(f))
		}
	}
}

func FuzzTransform(f *testing.F) {
	f.Add([]byte(`{"a":[1,2.5e10,"x"]}`))
	f.Add([]byte(`"\ud800"`))
	f.Fuzz(func(t *testing.T, doc []byte) {
		out, err := canon.Transform(doc)
		if err != nil {
			return
		}
		again, err := canon.Transform(out)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("canonical form is not a fixed point: %q -> %q (%v)", out, again, err)
		}
	})
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// NUMBER_PRECISION_LOSS details give the value the number would become in
// its canonical (RFC 8785, ECMAScript) form, not Go's float format.
func TestPrecisionLossDetail(t *testing.T) {
	t.Parallel()
	_, err := canon.Transform([]byte(`12345678901234567890`))
	var cerr *canon.Error
	if !errors.As(err, &cerr) || !strings.Contains(cerr.Detail, "would change to 12345678901234567000") {
		t.Fatalf("error %v, want the canonical 12345678901234567000 in its detail", err)
	}
}

func TestBalanced(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]bool{
		``: true, `[]`: true, `{"a":[1,{}]}`: true, `"[" `: true, `"\"["`: true,
		`[`: false, `[}`: false, `{]`: false, `]`: false, `"abc`: false, `["\"]`: false,
	} {
		if got := canon.Balanced([]byte(in)); got != want {
			t.Errorf("Balanced(%q) = %v, want %v", in, got, want)
		}
	}
}

// exactSmallest is the exact decimal form of the smallest double, 2^-1074:
// 751 significant digits.
func exactSmallest() string {
	return new(big.Float).SetFloat64(math.SmallestNonzeroFloat64).Text('e', 800)
}
