package cdc

import (
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/taskevent"
)

// recordWithHeaders is a record and the array behind its Headers, allocated
// together.
type recordWithHeaders struct {
	rec     kgo.Record
	headers [taskevent.NumHeaders]kgo.RecordHeader
}

// valuesLen is the number of bytes the values of hs take.
func valuesLen(hs *[taskevent.NumHeaders][2]string) int {
	n := 0
	for _, h := range hs {
		n += len(h[1])
	}
	return n
}

// appendHeaders sets out to the headers hs (taskevent.Headers, the header
// contract), in their order: the values are appended to buf and each
// header's Value is a sub-slice of it, capped at its length (appending to
// one value never overwrites the next). With valuesLen(hs) bytes of room in
// buf nothing is allocated; with less, buf grows, which is correct but
// allocates. It returns buf.
func appendHeaders(out *[taskevent.NumHeaders]kgo.RecordHeader, buf []byte, hs *[taskevent.NumHeaders][2]string) []byte {
	for i, h := range hs {
		var v []byte
		buf, v = appendValue(buf, h[1])
		out[i] = kgo.RecordHeader{Key: h[0], Value: v}
	}
	return buf
}

// appendValue appends s to buf and returns buf and the appended bytes,
// capped at their length.
func appendValue(buf []byte, s string) ([]byte, []byte) {
	n := len(buf)
	buf = append(buf, s...)
	return buf, buf[n:len(buf):len(buf)]
}
