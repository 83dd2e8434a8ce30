package canon

import (
	"bytes"
	"errors"
	"fmt"
	"math/big"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
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

// checkNumberExact is CheckNumber without its shortcut for literals of more
// than maxCanonicalDigits significant digits: the exact comparison decides.
func checkNumberExact(raw string) *Error {
	f, err := strconv.ParseFloat(raw, 64)
	if err != nil {
		return &Error{Code: CodeNumberOutOfRange}
	}
	mantissa, isInt := significand(raw)
	if f == 0 {
		if mantissa != "" {
			return &Error{Code: CodeNumberOutOfRange}
		}
		return nil
	}
	if isInt && len(mantissa) <= 15 || !isInt && len(mantissa) <= 17 {
		return nil
	}
	in, ok1 := new(big.Rat).SetString(raw)
	out, ok2 := new(big.Rat).SetString(strconv.FormatFloat(f, 'g', -1, 64))
	if !ok1 || !ok2 || in.Cmp(out) != 0 {
		return &Error{Code: CodeNumberPrecisionLoss}
	}
	return nil
}

// CheckNumber's shortcut (more significant digits than a canonical form
// has: precision loss at once) answers as the exact comparison does, on
// number literals of every shape up to 40 digits around the limit.
func TestCheckNumberShortcutAgrees(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	digits := func(n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte('0' + rng.IntN(10))
		}
		if n > 0 && b[0] == '0' {
			b[0] = '1' + byte(rng.IntN(9))
		}
		return string(b)
	}
	code := func(e *Error) string {
		if e == nil {
			return ""
		}
		return e.Code
	}
	for range 20000 {
		raw := digits(1 + rng.IntN(40))
		if rng.IntN(2) == 0 {
			raw += "." + digits(rng.IntN(25))
			raw = strings.TrimSuffix(raw, ".")
		}
		if rng.IntN(3) == 0 {
			raw += "e" + []string{"", "+", "-"}[rng.IntN(3)] + strconv.Itoa(rng.IntN(330))
		}
		if rng.IntN(2) == 0 {
			raw = "-" + raw
		}
		if got, want := code(CheckNumber(raw)), code(checkNumberExact(raw)); got != want {
			t.Fatalf("%s: %q, the exact comparison says %q", raw, got, want)
		}
	}
}
