// Package canon turns a JSON document into its RFC 8785 (JSON
// Canonicalization Scheme, JCS) form, after checking that the document is
// I-JSON (RFC 7493), which RFC 8785 section 3.2.2.3 requires of its input.
//
// Parsing and canonicalization are done by github.com/go-json-experiment/json
// (the Go team's JSON v2 implementation, whose jsontext.Value.Canonicalize
// implements RFC 8785); this package adds what that library leaves to the
// caller: a stable error code per kind of rejected input, a nesting limit, and
// converge's number policy.
//
// # Number policy
//
// RFC 8785 serializes every number as the IEEE-754 double nearest to it
// (ECMAScript Number.prototype.toString). A double cannot hold every decimal,
// and converge refuses to lose data silently, so a number is rejected with
// CodeNumberOutOfRange or CodeNumberPrecisionLoss when:
//
//   - its magnitude overflows a double (it would become infinite), or it is
//     not zero but underflows to zero (1e-400): NUMBER_OUT_OF_RANGE;
//   - it is written as an integer (no fraction, no exponent) and the canonical
//     form does not denote the same integer (12345678901234567890 would
//     become 12345678901234567000): NUMBER_PRECISION_LOSS;
//   - it has more than 17 significant digits and the canonical form does not
//     denote the same decimal value (0.10000000000000000000001 would become
//     0.1): NUMBER_PRECISION_LOSS.
//
// Every other number, in particular any fraction or exponent form with at
// most 17 significant digits (the way programs print doubles, as in
// canada.json), is taken to mean the nearest double, as RFC 7493 section 2.2
// and RFC 8785 define, and is written in its shortest round-trip form.
package canon

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/big"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
)

// MaxDepth is the deepest nesting of arrays and objects accepted (the
// top-level value is depth 1). Deeper documents get CodeNestingTooDeep.
const MaxDepth = 1000

// Stable error codes. They appear as the "code" member of API problem
// documents and as task terminal_error_code values; never rename one.
const (
	// CodeMalformedJSON: the input is not JSON text (RFC 8259).
	CodeMalformedJSON = "MALFORMED_JSON"
	// CodeInvalidUTF8: the input is not valid UTF-8 (RFC 8259 section 8.1).
	CodeInvalidUTF8 = "INVALID_UTF8"
	// CodeLoneSurrogate: a \u escape names an unpaired UTF-16 surrogate
	// (valid JSON, not I-JSON: RFC 7493 section 2.1).
	CodeLoneSurrogate = "LONE_SURROGATE"
	// CodeDuplicateMemberName: an object repeats a member name (RFC 7493
	// section 2.3).
	CodeDuplicateMemberName = "DUPLICATE_MEMBER_NAME"
	// CodeNumberOutOfRange: see the package doc's number policy.
	CodeNumberOutOfRange = "NUMBER_OUT_OF_RANGE"
	// CodeNumberPrecisionLoss: see the package doc's number policy.
	CodeNumberPrecisionLoss = "NUMBER_PRECISION_LOSS"
	// CodeNestingTooDeep: arrays and objects nest deeper than MaxDepth.
	CodeNestingTooDeep = "NESTING_TOO_DEEP"
)

// Error describes why a document was rejected. Code is one of the Code*
// constants; Offset is the byte offset in the input where the problem was
// found (-1 when unknown).
type Error struct {
	Code   string
	Detail string
	Offset int64
}

func (e *Error) Error() string {
	if e.Offset >= 0 {
		return fmt.Sprintf("%s at byte %d: %s", e.Code, e.Offset, e.Detail)
	}
	return e.Code + ": " + e.Detail
}

// Syntax reports whether the error is a syntax error of the JSON text (as
// opposed to valid JSON that is not I-JSON). The API answers 400 for syntax
// errors and 422 for the others.
func (e *Error) Syntax() bool {
	return e.Code == CodeMalformedJSON || e.Code == CodeInvalidUTF8
}

// Transform validates doc (one JSON value, surrounding whitespace allowed) and
// returns its RFC 8785 canonical form in a new slice. The error is always an
// *Error.
//
// The library parses the document once: when it canonicalizes it and the
// document keeps the number policy and the nesting limit (policyHolds, a
// scan of its bytes that the library has just shown to be JSON), the
// canonical form is returned. Only a document the library refuses, or one
// that breaks the policy, is parsed again, by Validate, for the error's code
// and offset. The answer is Validate's, then Canonicalize's, for every input
// (TestTransformAnswersAsValidateThenCanonicalize and its fuzz target): the
// policy and the library decide, the scan only spares a valid document its
// second parse (Validate's token walk was 40 % of Transform's CPU,
// issue 11).
func Transform(doc []byte) ([]byte, error) {
	v := jsontext.Value(bytes.Clone(doc))
	cerr := v.Canonicalize()
	if cerr == nil && policyHolds(doc) {
		return []byte(v), nil
	}
	if err := Validate(doc); err != nil {
		return nil, err
	}
	if cerr != nil {
		// Validate accepted the document, so this is a library disagreement;
		// still report it as a rejection, never as a crash.
		return nil, classify(cerr, -1)
	}
	return []byte(v), nil
}

// policyHolds reports whether doc, which must be one valid JSON value (the
// library parsed it), nests no deeper than MaxDepth and has only numbers
// CheckNumber accepts. Outside strings, valid JSON holds a number exactly
// where a '-' or a digit starts a run of number characters.
func policyHolds(doc []byte) bool {
	depth := 0
	var str jsonStrings
	for i := 0; i < len(doc); i++ {
		c := doc[i]
		if str.holds(c) {
			continue
		}
		switch {
		case c == '[' || c == '{':
			if depth++; depth > MaxDepth {
				return false
			}
		case c == ']' || c == '}':
			depth--
		case c == '-' || c >= '0' && c <= '9':
			j := i + 1
			for j < len(doc) && isNumberByte(doc[j]) {
				j++
			}
			if CheckNumber(string(doc[i:j])) != nil {
				return false
			}
			i = j - 1
		}
	}
	return true
}

// isNumberByte reports whether c may continue a JSON number literal.
func isNumberByte(c byte) bool {
	return c >= '0' && c <= '9' || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'
}

// Validate checks that doc is a single I-JSON value acceptable under the
// package's number policy and nesting limit. The error is always an *Error.
func Validate(doc []byte) error {
	if !utf8.Valid(doc) {
		off := invalidUTF8Offset(doc)
		return &Error{Code: CodeInvalidUTF8, Detail: "input is not valid UTF-8", Offset: off}
	}
	// A *bytes.Buffer is parsed in place; any other reader is copied into
	// the decoder's growing buffer (half the bytes a create allocated).
	dec := jsontext.NewDecoder(bytes.NewBuffer(doc))
	depth := 0
	for {
		tok, err := dec.ReadToken()
		if err == io.EOF {
			if depth != 0 {
				return &Error{Code: CodeMalformedJSON, Detail: "unexpected end of input", Offset: dec.InputOffset()}
			}
			return nil
		}
		if err != nil {
			return classify(err, dec.InputOffset())
		}
		switch tok.Kind() {
		case '{', '[':
			depth++
			if depth > MaxDepth {
				if !Balanced(doc) {
					// Not JSON at all: an unclosed array or object is
					// malformed, however deep (issue 13).
					return &Error{Code: CodeMalformedJSON, Detail: "unexpected end of input: unclosed arrays or objects", Offset: int64(len(doc))}
				}
				return &Error{Code: CodeNestingTooDeep, Detail: fmt.Sprintf("nesting deeper than %d", MaxDepth), Offset: dec.InputOffset()}
			}
		case '}', ']':
			depth--
		case '0':
			if e := CheckNumber(tok.String()); e != nil {
				e.Offset = dec.InputOffset()
				return e
			}
		}
	}
}

// CheckNumber applies the number policy (package doc) to one JSON number
// literal. It returns nil when the number is accepted.
func CheckNumber(raw string) *Error {
	f, err := strconv.ParseFloat(raw, 64)
	if err != nil {
		return &Error{Code: CodeNumberOutOfRange, Detail: fmt.Sprintf("number %s does not fit an IEEE-754 double", clip(raw)), Offset: -1}
	}
	mantissa, isInt := significand(raw)
	if f == 0 {
		if mantissa != "" {
			return &Error{Code: CodeNumberOutOfRange, Detail: fmt.Sprintf("number %s underflows to zero", clip(raw)), Offset: -1}
		}
		return nil
	}
	if isInt && len(mantissa) <= 15 {
		return nil // below 10^15 < 2^53 with no fraction: exact
	}
	if !isInt && len(mantissa) <= 17 {
		return nil // the usual rendering of a double: nearest double is meant
	}
	if len(mantissa) > maxCanonicalDigits {
		// The canonical form cannot denote this decimal: decided without
		// the exact comparison below, whose cost grows faster than the
		// literal (a million digits took seconds per check).
		return &Error{Code: CodeNumberPrecisionLoss, Detail: fmt.Sprintf("number %s would change to %s", clip(raw), canonicalNumber(f)), Offset: -1}
	}
	in, ok1 := new(big.Rat).SetString(raw)
	out, ok2 := new(big.Rat).SetString(strconv.FormatFloat(f, 'g', -1, 64))
	if !ok1 || !ok2 || in.Cmp(out) != 0 {
		return &Error{Code: CodeNumberPrecisionLoss, Detail: fmt.Sprintf("number %s would change to %s", clip(raw), canonicalNumber(f)), Offset: -1}
	}
	return nil
}

// maxCanonicalDigits is the most significant digits a number's canonical
// form has (the shortest decimal that reads back as the same double: 17 at
// most), so a literal with more, leading and trailing zeros aside, never
// denotes the same decimal as its canonical form.
const maxCanonicalDigits = 17

// canonicalNumber is f as RFC 8785 writes it (ECMAScript
// Number.prototype.toString: 12345678901234567000, not Go's
// 1.2345678901234567e+19), for error details.
func canonicalNumber(f float64) string {
	v := jsontext.Value(strconv.FormatFloat(f, 'g', -1, 64))
	_ = v.Canonicalize() // a finite double's 'g' form is a valid JSON number
	return string(v)
}

// Balanced reports whether every array and object opened in b (outside
// strings) is closed, in order: false for a body that ends inside a string
// or with unclosed brackets. It tells a document nested too deeply
// (NESTING_TOO_DEEP) from one that is not JSON at all (MALFORMED_JSON)
// without a parser's depth limit; it does not validate anything else.
func Balanced(b []byte) bool {
	var stack []byte
	var str jsonStrings
	for _, c := range b {
		if str.holds(c) {
			continue
		}
		switch {
		case c == '[' || c == '{':
			stack = append(stack, c)
		case c == ']' || c == '}':
			if len(stack) == 0 || (c == ']') != (stack[len(stack)-1] == '[') {
				return false
			}
			stack = stack[:len(stack)-1]
		}
	}
	return !str.in && len(stack) == 0
}

// jsonStrings follows a JSON text byte by byte and tells the bytes of its
// strings (their quotes and escapes included) from the others.
type jsonStrings struct{ in, escaped bool }

// holds reports whether c, the text's next byte, belongs to a string.
func (s *jsonStrings) holds(c byte) bool {
	switch {
	case !s.in:
		s.in = c == '"'
		return s.in
	case s.escaped:
		s.escaped = false
	case c == '\\':
		s.escaped = true
	case c == '"':
		s.in = false
	}
	return true
}

// significand returns the significant digits of a JSON number literal
// (leading and trailing zeros removed, sign, point and exponent dropped) and
// whether the literal is written as an integer.
func significand(raw string) (string, bool) {
	s := strings.TrimPrefix(raw, "-")
	isInt := true
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		s = s[:i]
		isInt = false
	}
	if i := strings.IndexByte(s, '.'); i >= 0 {
		s = s[:i] + s[i+1:]
		isInt = false
	}
	s = strings.TrimLeft(s, "0")
	s = strings.TrimRight(s, "0")
	return s, isInt
}

func classify(err error, off int64) *Error {
	msg := err.Error()
	var se *jsontext.SyntacticError
	if errors.As(err, &se) {
		off = se.ByteOffset
	}
	cause := Cause(err)
	switch {
	case errors.Is(err, jsontext.ErrDuplicateName):
		return &Error{Code: CodeDuplicateMemberName, Detail: trimPrefix(msg), Offset: off}
	case strings.Contains(cause, "surrogate"):
		return &Error{Code: CodeLoneSurrogate, Detail: trimPrefix(msg), Offset: off}
	case strings.Contains(cause, "invalid UTF-8"):
		return &Error{Code: CodeInvalidUTF8, Detail: trimPrefix(msg), Offset: off}
	case strings.Contains(cause, "exceeded max depth"):
		return &Error{Code: CodeNestingTooDeep, Detail: trimPrefix(msg), Offset: off} // callers check Balanced first
	default:
		return &Error{Code: CodeMalformedJSON, Detail: trimPrefix(msg), Offset: off}
	}
}

func trimPrefix(msg string) string { return strings.TrimPrefix(msg, "jsontext: ") }

// Cause is the message of a JSON library error's cause: without the JSON
// pointer the library adds to its message, which holds member names taken
// from the document. A classification by message must read Cause: the
// whole message of {"exceeded max depth":tru} says "exceeded max depth",
// and the document is only malformed.
func Cause(err error) string {
	var se *jsontext.SyntacticError
	if errors.As(err, &se) && se.Err != nil {
		return se.Err.Error()
	}
	return err.Error()
}

func invalidUTF8Offset(b []byte) int64 {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n <= 1 {
			return int64(i)
		}
		i += n
	}
	return -1
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

// SHA256Hex returns the lowercase hex SHA-256 of b (64 characters), the form
// every *_sha256 column and header of converge uses.
func SHA256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
