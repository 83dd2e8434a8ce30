package cdc

import (
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
)

// numHeaders is the number of headers of a task-event record
// (taskevent.Headers).
const numHeaders = 5

// contentTypeJSON is the HeaderContentType value of every record.
const contentTypeJSON = "application/json"

// recordWithHeaders is a record and the array behind its Headers, allocated
// together.
type recordWithHeaders struct {
	rec     kgo.Record
	headers [numHeaders]kgo.RecordHeader
}

// maxInt64Len is the length of the longest decimal int64,
// -9223372036854775808.
const maxInt64Len = 20

// headerValuesLen is the number of bytes appendHeaders appends at most.
func headerValuesLen(eventID, eventType, payloadSHA256 string) int {
	return len(eventID) + len(eventType) + maxInt64Len + len(payloadSHA256) + len(contentTypeJSON)
}

// appendHeaders sets hs to the headers taskevent.Headers(eventID, eventType,
// version, payloadSHA256) returns, in its order, without building the
// intermediate [][2]string: the values are appended to buf and each header's
// Value is a sub-slice of it, capped at its length (appending to one value
// never overwrites the next). With headerValuesLen bytes of room in buf
// nothing is allocated; with less, buf grows, which is correct but
// allocates. It returns buf.
func appendHeaders(hs *[numHeaders]kgo.RecordHeader, buf []byte, eventID, eventType string, version int64, payloadSHA256 string) []byte {
	var v []byte
	buf, v = appendValue(buf, eventID)
	hs[0] = kgo.RecordHeader{Key: taskevent.HeaderEventID, Value: v}
	buf, v = appendValue(buf, eventType)
	hs[1] = kgo.RecordHeader{Key: taskevent.HeaderEventType, Value: v}
	n := len(buf)
	buf = strconv.AppendInt(buf, version, 10)
	hs[2] = kgo.RecordHeader{Key: taskevent.HeaderAggregateVersion, Value: buf[n:len(buf):len(buf)]}
	buf, v = appendValue(buf, payloadSHA256)
	hs[3] = kgo.RecordHeader{Key: taskevent.HeaderPayloadSHA256, Value: v}
	buf, v = appendValue(buf, contentTypeJSON)
	hs[4] = kgo.RecordHeader{Key: taskevent.HeaderContentType, Value: v}
	return buf
}

// appendValue appends s to buf and returns buf and the appended bytes,
// capped at their length.
func appendValue(buf []byte, s string) ([]byte, []byte) {
	n := len(buf)
	buf = append(buf, s...)
	return buf, buf[n:len(buf):len(buf)]
}
