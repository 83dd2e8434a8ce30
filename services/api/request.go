package api

import (
	"bytes"
	"errors"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"

	"github.com/converge-run/converge/internal/canon"
	"github.com/converge-run/converge/internal/ident"
)

// OutputFormatJCS is the only output format: the RFC 8785 canonical form.
const OutputFormatJCS = "jcs"

// ValidIdempotencyKey reports whether the API accepts key as an
// Idempotency-Key (after unquoting): 6 to 255 characters of A–Z, a–z, 0–9,
// '_', '.', ':' and '-'; any other key is answered 400
// IDEMPOTENCY_KEY_INVALID. For clients that make keys (converge loadgen).
func ValidIdempotencyKey(key string) bool { return ident.Valid(key, 6, 255, false) }

// checkContentType accepts application/json with optional parameters; a
// charset parameter, when present, must be utf-8 (RFC 8259 section 8.1).
//
// The body must not be content-coded (RFC 9110 section 8.4: an unsupported
// coding is answered 415) and Content-Type must appear once.
func checkContentType(h http.Header) error {
	if ce := strings.TrimSpace(strings.Join(h.Values("Content-Encoding"), ",")); ce != "" && !strings.EqualFold(ce, "identity") {
		return newError(CodeUnsupportedMediaType, "Content-Encoding %q is not supported; send the JSON body uncompressed", clip(ce, 40))
	}
	if len(h.Values("Content-Type")) > 1 {
		return newError(CodeUnsupportedMediaType, "Content-Type appears more than once")
	}
	ct := h.Get("Content-Type")
	if ct == "" {
		return newError(CodeUnsupportedMediaType, "Content-Type header missing; send application/json")
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != "application/json" {
		return newError(CodeUnsupportedMediaType, "Content-Type %q is not application/json", clip(ct, 100))
	}
	if cs, ok := params["charset"]; ok && !strings.EqualFold(cs, "utf-8") {
		return newError(CodeUnsupportedMediaType, "charset %q is not utf-8", clip(cs, 40))
	}
	return nil
}

// parseIdempotencyKey returns the Idempotency-Key header's key. Following
// the IETF httpapi Idempotency-Key draft the value is a structured-field
// string ("key"); a bare token (key) is accepted too. The key must match
// ^[A-Za-z0-9_.:-]{6,255}$ and the header must appear once.
func parseIdempotencyKey(h http.Header) (string, error) {
	vals := h.Values("Idempotency-Key")
	if len(vals) == 0 || strings.TrimSpace(strings.Join(vals, "")) == "" {
		return "", newError(CodeIdempotencyKeyMissing, "send an Idempotency-Key header: one key per intended task, reused on every retry")
	}
	if len(vals) > 1 {
		return "", newError(CodeIdempotencyKeyInvalid, "Idempotency-Key header sent %d times; send it once", len(vals))
	}
	v := strings.Trim(vals[0], " \t")
	if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
		v = v[1 : len(v)-1]
	}
	if !ValidIdempotencyKey(v) {
		return "", newError(CodeIdempotencyKeyInvalid, "Idempotency-Key must be 6 to 255 characters of A-Z a-z 0-9 _ . : - (optionally in double quotes)")
	}
	return v, nil
}

// createRequest is the parsed body of POST /v1/tasks.
type createRequest struct {
	Document     []byte // the "document" member's JSON text, as received
	OutputFormat string
}

// parseCreateRequest parses the body {"document": <JSON>, "output_format":
// "jcs"}. It checks the envelope only; the document is checked by
// canon.Transform afterwards, so problems inside it get canon's precise
// codes. Errors, most fundamental first:
//
//   - 400 INVALID_UTF8: the body is not UTF-8;
//   - 400 MALFORMED_JSON: not JSON, not an object, or trailing data;
//   - 422 NESTING_TOO_DEEP: deeper than the parser's limit (10000);
//   - 400 DUPLICATE_MEMBER_NAME: "document" or "output_format" repeated;
//   - 422 UNKNOWN_MEMBER, UNSUPPORTED_OUTPUT_FORMAT, DOCUMENT_MISSING.
func parseCreateRequest(body []byte) (*createRequest, error) {
	if !utf8.Valid(body) {
		return nil, canonError(canon.CodeInvalidUTF8, "request body is not valid UTF-8", invalidUTF8Offset(body))
	}
	// Duplicate names and lone surrogates are allowed here so that, inside
	// the document, canon reports them with their own codes. A
	// *bytes.Buffer is parsed in place, without a copy (canon.Validate).
	dec := jsontext.NewDecoder(bytes.NewBuffer(body), jsontext.AllowDuplicateNames(true), jsontext.AllowInvalidUTF8(true))
	tok, err := dec.ReadToken()
	if err != nil {
		return nil, syntaxError(err, dec, body)
	}
	if tok.Kind() != '{' {
		return nil, canonError(canon.CodeMalformedJSON, "request body must be a JSON object {\"document\": ...}", 0)
	}
	var (
		req                 = &createRequest{OutputFormat: OutputFormatJCS}
		haveDoc, haveFormat bool
		dup, semantic       error
	)
	for dec.PeekKind() != '}' {
		tok, err := dec.ReadToken()
		if err != nil {
			return nil, syntaxError(err, dec, body)
		}
		name := tok.String()
		val, err := dec.ReadValue()
		if err != nil {
			return nil, syntaxError(err, dec, body)
		}
		switch name {
		case "document":
			if haveDoc && dup == nil {
				dup = newError(canon.CodeDuplicateMemberName, "member \"document\" appears more than once")
			}
			haveDoc = true
			req.Document = bytes.Clone(val)
		case "output_format":
			if haveFormat && dup == nil {
				dup = newError(canon.CodeDuplicateMemberName, "member \"output_format\" appears more than once")
			}
			haveFormat = true
			if val.Kind() != '"' {
				if semantic == nil {
					semantic = newError(CodeUnsupportedOutputFormat, "output_format must be the string %q", OutputFormatJCS)
				}
				continue
			}
			s, err := jsontext.AppendUnquote(nil, val)
			if err != nil {
				s = []byte(val)
			}
			req.OutputFormat = string(s)
		default:
			if semantic == nil {
				semantic = newError(CodeUnknownMember, "unknown member %q: the request object has \"document\" and optional \"output_format\"", clip(name, 64))
			}
		}
	}
	if _, err := dec.ReadToken(); err != nil { // the closing '}'
		return nil, syntaxError(err, dec, body)
	}
	if _, err := dec.ReadToken(); err != io.EOF {
		return nil, canonError(canon.CodeMalformedJSON, "trailing data after the request object", dec.InputOffset())
	}
	switch {
	case dup != nil:
		return nil, dup
	case semantic != nil:
		return nil, semantic
	case !haveDoc:
		return nil, newError(CodeDocumentMissing, "the request object has no \"document\" member")
	case req.OutputFormat != OutputFormatJCS:
		return nil, newError(CodeUnsupportedOutputFormat, "output_format %q is not supported; use %q", clip(req.OutputFormat, 64), OutputFormatJCS)
	}
	return req, nil
}

// syntaxError converts an envelope parse error: the parser's depth limit
// becomes NESTING_TOO_DEEP (422) when body's brackets are balanced (an
// unclosed body is not JSON: MALFORMED_JSON), everything else
// MALFORMED_JSON (400).
func syntaxError(err error, dec *jsontext.Decoder, body []byte) error {
	off := dec.InputOffset()
	var se *jsontext.SyntacticError
	if errors.As(err, &se) {
		off = se.ByteOffset
	}
	if strings.Contains(canon.Cause(err), "exceeded max depth") {
		if !canon.Balanced(body) {
			// Unclosed, so not JSON at all, however deep (issue 13).
			return canonError(canon.CodeMalformedJSON, "unexpected end of request body: unclosed arrays or objects", int64(len(body)))
		}
		return canonError(canon.CodeNestingTooDeep, "request nests deeper than the parser allows", off)
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return canonError(canon.CodeMalformedJSON, "unexpected end of request body", off)
	}
	return canonError(canon.CodeMalformedJSON, strings.TrimPrefix(err.Error(), "jsontext: "), off)
}

// canonError builds an *Error carrying a canon code for a problem of the
// request body (offset off, -1 when unknown); its status comes from kinds.
func canonError(code, detail string, off int64) error {
	if off >= 0 {
		return &Error{Code: code, Detail: detail + " (request body byte " + strconv.FormatInt(off, 10) + ")"}
	}
	return &Error{Code: code, Detail: detail}
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

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}
