// Package docgen generates the documents of load tests and benchmarks
// (converge loadgen, make bench, API benchmarks): JSON objects of a chosen
// size that differ by a sequence number, so that every one is a new intent.
package docgen

import "strconv"

// Document returns a JSON object of about size bytes that differs by seq:
// {"seq":N,"source":"loadgen","items":[...],"pad":"..."}. Its members
// include a double, a boolean and a non-ASCII string, so canonicalizing it
// is representative work.
func Document(seq, size int) []byte {
	b := make([]byte, 0, size+64)
	b = append(b, `{"seq":`...)
	b = strconv.AppendInt(b, int64(seq), 10)
	b = append(b, `,"source":"loadgen","items":[`...)
	for k := 0; k < 8 && len(b) < size/2; k++ {
		if k > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"id":`...)
		b = strconv.AppendInt(b, int64(k), 10)
		b = append(b, `,"value":1.5e3,"ok":true,"name":"item \u00e9"}`...)
	}
	b = append(b, `],"pad":"`...)
	for len(b) < size-2 {
		b = append(b, 'x')
	}
	return append(b, `"}`...)
}
