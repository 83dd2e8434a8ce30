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
	if !exactInts(e.TaskVersion, int64(e.SchemaVersion)) || !encodableTimes(e.OccurredAt) {
		return dst, false
	}
	w := canonicalWriter{dst: dst, ok: true}
	w.raw(`{"event_id":`)
	w.str(e.EventID)
	w.raw(`,"event_type":`)
	w.str(e.EventType)
	w.raw(`,"occurred_at":`)
	w.time(e.OccurredAt)
	w.raw(`,"schema_version":`)
	w.int(int64(e.SchemaVersion))
	w.raw(`,"task":`)
	var ok bool
	if w.dst, ok = AppendTask(w.dst, &e.Task); !ok {
		return dst, false
	}
	w.raw(`,"task_id":`)
	w.str(e.TaskID)
	w.raw(`,"task_version":`)
	w.int(e.TaskVersion)
	w.raw(`}`)
	return w.dst, w.ok
}

// AppendTask appends the RFC 8785 form of t to dst (the "task" member of
// an event's canonical value; the Redis task view stores it too). It
// reports false, with dst unspecified, for a value whose canonical form it
// does not produce, as appendCanonical: a string that is not valid UTF-8,
// an integer beyond ±(2^53-1), a time whose year is outside 0000–9999 or
// whose offset is not whole minutes. Callers then use encoding/json, which
// rejects or replaces those values (TestAppendTaskMatchesEncodingJSON).
func AppendTask(dst []byte, t *Task) ([]byte, bool) {
	if !exactInts(t.Version, int64(t.Attempt), t.InputSize) ||
		(t.ArtifactSize != nil && !exactInts(*t.ArtifactSize)) ||
		!encodableTimes(t.CreatedAt, t.UpdatedAt) ||
		(t.CompletedAt != nil && !encodableTimes(*t.CompletedAt)) {
		return dst, false
	}
	w := canonicalWriter{dst: dst, ok: true}
	w.raw(`{"artifact_sha256":`)
	w.optStr(t.ArtifactSHA256)
	w.raw(`,"artifact_size":`)
	if t.ArtifactSize == nil {
		w.raw("null")
	} else {
		w.int(*t.ArtifactSize)
	}
	w.raw(`,"attempt":`)
	w.int(int64(t.Attempt))
	w.raw(`,"completed_at":`)
	if t.CompletedAt == nil {
		w.raw("null")
	} else {
		w.time(*t.CompletedAt)
	}
	w.raw(`,"created_at":`)
	w.time(t.CreatedAt)
	w.raw(`,"input_sha256":`)
	w.str(t.InputSHA256)
	w.raw(`,"input_size":`)
	w.int(t.InputSize)
	w.raw(`,"output_format":`)
	w.str(t.OutputFormat)
	w.raw(`,"status":`)
	w.str(t.Status)
	w.raw(`,"task_id":`)
	w.str(t.TaskID)
	if t.TenantID != "" {
		w.raw(`,"tenant_id":`)
		w.str(t.TenantID)
	}
	w.raw(`,"terminal_error_code":`)
	w.optStr(t.TerminalErrorCode)
	w.raw(`,"updated_at":`)
	w.time(t.UpdatedAt)
	w.raw(`,"version":`)
	w.int(t.Version)
	w.raw(`}`)
	return w.dst, w.ok
}

// canonicalWriter appends JSON values in their RFC 8785 form; ok turns
// false at a string that is not valid UTF-8.
type canonicalWriter struct {
	dst []byte
	ok  bool
}

func (w *canonicalWriter) raw(s string) { w.dst = append(w.dst, s...) }
func (w *canonicalWriter) int(v int64)  { w.dst = strconv.AppendInt(w.dst, v, 10) }
func (w *canonicalWriter) time(v time.Time) {
	w.dst = append(w.dst, '"')
	w.dst = v.AppendFormat(w.dst, time.RFC3339Nano)
	w.dst = append(w.dst, '"')
}

func (w *canonicalWriter) str(s string) {
	if !utf8.ValidString(s) {
		w.ok = false
		return
	}
	var err error
	if w.dst, err = jsontext.AppendQuote(w.dst, s); err != nil {
		w.ok = false
	}
}

func (w *canonicalWriter) optStr(s *string) {
	if s == nil {
		w.raw("null")
		return
	}
	w.str(*s)
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
