package canon

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/go-json-experiment/json/jsontext"

	"github.com/converge-run/converge/internal/corpus"
)

// validateThenCanonicalize is Transform as it was before its fast path:
// Validate, then the library's Canonicalize. Transform must answer as it
// does, for every input.
func validateThenCanonicalize(doc []byte) ([]byte, error) {
	if err := Validate(doc); err != nil {
		return nil, err
	}
	v := jsontext.Value(bytes.Clone(doc))
	if err := v.Canonicalize(); err != nil {
		return nil, classify(err, -1)
	}
	return []byte(v), nil
}

// sameAnswer fails t when Transform's answer for doc differs from
// validateThenCanonicalize's: the same bytes, or the same error code at the
// same offset.
func sameAnswer(t *testing.T, name string, doc []byte) {
	t.Helper()
	got, gerr := Transform(doc)
	want, werr := validateThenCanonicalize(doc)
	var g, w *Error
	switch {
	case gerr == nil && werr == nil:
		if !bytes.Equal(got, want) {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	case !errors.As(gerr, &g) || !errors.As(werr, &w):
		t.Errorf("%s: error %v, want %v", name, gerr, werr)
	case g.Code != w.Code || g.Offset != w.Offset:
		t.Errorf("%s: error %v, want %v", name, gerr, werr)
	}
}

// Transform parses a valid document once (policyHolds spares it
// Validate's token walk) and answers exactly as Validate then Canonicalize
// did: on the project's cases (numbers at every edge of the policy, inside
// and outside strings, nesting at and past the limit, every rejection),
// and on every file of the corpus when it is there.
func TestTransformAnswersAsValidateThenCanonicalize(t *testing.T) {
	t.Parallel()
	cases := []string{
		``, ` `, `1`, `-0`, `1.0`, `1e23`, `9007199254740993`, `12345678901234567`, `0.10000000000000000000001`,
		`1e400`, `-1e400`, `1e-400`, `0e-400`, `5e-324`, `1 2`, `[1,]`, `{"a":1,"a":2}`, `"\ud800"`, "\"\xff\"",
		`{"n":"9007199254740993","m":9007199254740993}`, `{"s":"a\"12345678901234567890"}`, `["\\",12345678901234567890]`,
		`{"a":[1,-2.5e-3,{"b":1E+2}]}`, `[-]`, `[01]`, `[1.]`, `[.5]`, `[1e]`, `{"a":tru}`, `[1,2,3]x`, `"` + strings.Repeat("9", 400) + `"`,
		`[` + strings.Repeat("9", 400) + `]`, `{"k":"\u0000"}`, "{\"\\u00e9\":\"é\",\"e\":1}",
		strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth),
		strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1),
		strings.Repeat(`{"a":`, MaxDepth+1) + `"x\"}"` + strings.Repeat("}", MaxDepth+1),
		strings.Repeat("[", 20000) + strings.Repeat("]", 20000),
		strings.Repeat("[", 5000),
	}
	for i, c := range cases {
		sameAnswer(t, fmt.Sprintf("case %d (%.20q)", i, c), []byte(c))
	}
	for _, pattern := range []string{"jsontestsuite/*.json", "realworld/*.json", "jcs/input/*.json"} {
		for _, f := range corpus.Optional(t, pattern, 1) {
			doc, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			sameAnswer(t, filepath.Base(f), doc)
		}
	}
}

func FuzzTransformAnswersAsValidateThenCanonicalize(f *testing.F) {
	for _, s := range []string{`{"a":[1,2.5e10,"x"]}`, `"\ud800"`, `[12345678901234567890]`, `{"a":"-1","b":-1e400}`, `[[[1]]]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, doc []byte) { sameAnswer(t, "fuzz", doc) })
}
