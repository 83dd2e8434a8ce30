package taskevent

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
)

// maxExactInt is 2^53 - 1: integers up to it survive IEEE-754 doubles, so
// RFC 8785 (which formats numbers as doubles) writes them as plain decimals.
const maxExactInt = 1<<53 - 1

// appendCanonical appends the RFC 8785 form of e to dst without a
// reflection-based marshal and a re-parse. Members are written in RFC 8785
// order (UTF-16 code units; every name is ASCII, so byte order). It reports
// false, with dst unspecified, when e holds a value whose canonical form it
// does not produce (a string that is not valid UTF-8, an integer beyond
// ±(2^53-1), a time whose year is outside 0000–9999); Encode then takes the
// generic path, which rejects or formats those values exactly as before.
// TestEncodeFastPathMatchesGeneric compares both paths.
func appendCanonical(dst []byte, e *Event) ([]byte, bool) {
	t := &e.Task
	if !exactInts(e.TaskVersion, int64(e.SchemaVersion), t.Version, int64(t.Attempt), t.InputSize) ||
		(t.ArtifactSize != nil && !exactInts(*t.ArtifactSize)) ||
		!encodableTimes(e.OccurredAt, t.CreatedAt, t.UpdatedAt) ||
		(t.CompletedAt != nil && !encodableTimes(*t.CompletedAt)) {
		return dst, false
	}
	ok := true
	str := func(s string) {
		if !utf8.ValidString(s) {
			ok = false
			return
		}
		var err error
		if dst, err = jsontext.AppendQuote(dst, s); err != nil {
			ok = false
		}
	}
	optStr := func(s *string) {
		if s == nil {
			dst = append(dst, "null"...)
			return
		}
		str(*s)
	}
	tm := func(v time.Time) {
		dst = append(dst, '"')
		dst = v.AppendFormat(dst, time.RFC3339Nano)
		dst = append(dst, '"')
	}

	dst = append(dst, `{"event_id":`...)
	str(e.EventID)
	dst = append(dst, `,"event_type":`...)
	str(e.EventType)
	dst = append(dst, `,"occurred_at":`...)
	tm(e.OccurredAt)
	dst = append(dst, `,"schema_version":`...)
	dst = strconv.AppendInt(dst, int64(e.SchemaVersion), 10)

	dst = append(dst, `,"task":{"artifact_sha256":`...)
	optStr(t.ArtifactSHA256)
	dst = append(dst, `,"artifact_size":`...)
	if t.ArtifactSize == nil {
		dst = append(dst, "null"...)
	} else {
		dst = strconv.AppendInt(dst, *t.ArtifactSize, 10)
	}
	dst = append(dst, `,"attempt":`...)
	dst = strconv.AppendInt(dst, int64(t.Attempt), 10)
	dst = append(dst, `,"completed_at":`...)
	if t.CompletedAt == nil {
		dst = append(dst, "null"...)
	} else {
		tm(*t.CompletedAt)
	}
	dst = append(dst, `,"created_at":`...)
	tm(t.CreatedAt)
	dst = append(dst, `,"input_sha256":`...)
	str(t.InputSHA256)
	dst = append(dst, `,"input_size":`...)
	dst = strconv.AppendInt(dst, t.InputSize, 10)
	dst = append(dst, `,"output_format":`...)
	str(t.OutputFormat)
	dst = append(dst, `,"status":`...)
	str(t.Status)
	dst = append(dst, `,"task_id":`...)
	str(t.TaskID)
	if t.TenantID != "" {
		dst = append(dst, `,"tenant_id":`...)
		str(t.TenantID)
	}
	dst = append(dst, `,"terminal_error_code":`...)
	optStr(t.TerminalErrorCode)
	dst = append(dst, `,"updated_at":`...)
	tm(t.UpdatedAt)
	dst = append(dst, `,"version":`...)
	dst = strconv.AppendInt(dst, t.Version, 10)
	dst = append(dst, '}')

	dst = append(dst, `,"task_id":`...)
	str(e.TaskID)
	dst = append(dst, `,"task_version":`...)
	dst = strconv.AppendInt(dst, e.TaskVersion, 10)
	dst = append(dst, '}')
	return dst, ok
}

func exactInts(vs ...int64) bool {
	for _, v := range vs {
		if v > maxExactInt || v < -maxExactInt {
			return false
		}
	}
	return true
}

// encodableTimes reports whether every t is one the fast path formats
// exactly as encoding/json does (RFC 3339 with nanoseconds): a year in
// 0000–9999 and a zone offset of whole minutes under 24 hours
// (time.Time.MarshalJSON refuses other years and offsets).
func encodableTimes(ts ...time.Time) bool {
	for _, t := range ts {
		if y := t.Year(); y < 0 || y > 9999 {
			return false
		}
		if _, off := t.Zone(); off%60 != 0 || off <= -24*3600 || off >= 24*3600 {
			return false
		}
	}
	return true
}

// sha256Hex is canon.SHA256Hex without the intermediate allocations.
func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	var out [sha256.Size * 2]byte
	hex.Encode(out[:], sum[:])
	return string(out[:])
}
