package cdc

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/converge-run/converge/internal/outbox"
	"github.com/converge-run/converge/internal/taskevent"
)

// Columns of outbox_event the relay reads, mapped by name from the pgoutput
// RelationMessage (never by position: a migration may add columns).
const (
	colOutboxID = iota
	colAggregateID
	colAggregateVersion
	colEventType
	colPayload
	colPayloadSHA256
	colTenantID // optional: absent before migration 00007
	numCols
)

var outboxColumns = [numCols]string{
	colOutboxID:         "outbox_id",
	colAggregateID:      "aggregate_id",
	colAggregateVersion: "aggregate_version",
	colEventType:        "event_type",
	colPayload:          "payload",
	colPayloadSHA256:    "payload_sha256",
	colTenantID:         "tenant_id",
}

// relation is a decoded pgoutput RelationMessage. outbox is false for any
// table other than public.outbox_event (a publication FOR ALL TABLES): its
// rows are ignored.
type relation struct {
	name   string
	outbox bool
	index  [numCols]int // position of each outbox column in the tuple
	ncols  int
}

// newRelation maps the columns of m. It fails with a *mismatchError
// wrapping ErrRelationMismatch (reason columns) when m is
// public.outbox_event but lacks a column the relay needs (tenant_id is
// optional). Any other relation maps with outbox false.
func newRelation(m *pglogrepl.RelationMessage) (*relation, error) {
	rel := &relation{name: m.Namespace + "." + m.RelationName, ncols: len(m.Columns)}
	if m.Namespace != outboxSchema || m.RelationName != outboxTable {
		return rel, nil
	}
	rel.outbox = true
	for i := range rel.index {
		rel.index[i] = -1
	}
	for pos, c := range m.Columns {
		for i, name := range outboxColumns {
			if c.Name == name {
				rel.index[i] = pos
			}
		}
	}
	var missing []string
	for i, pos := range rel.index {
		if pos < 0 && i != colTenantID {
			missing = append(missing, outboxColumns[i])
		}
	}
	if len(missing) > 0 {
		return nil, &mismatchError{sentinel: ErrRelationMismatch, reason: mismatchColumns, stream: true,
			msg: fmt.Sprintf("relation %s (oid %d) has no column %s (a migration renamed or dropped it; the relay reads %s)",
				rel.name, m.RelationID, strings.Join(missing, ", "), strings.Join(outboxColumns[:colTenantID], ", "))}
	}
	return rel, nil
}

// outboxRow is one inserted outbox_event row. Its fields are copies: the
// tuple's bytes belong to the connection's read buffer. The four text fields
// share one allocation (they are substrings of one string).
type outboxRow struct {
	outboxID         string
	aggregateID      string
	aggregateVersion int64
	eventType        string
	payload          []byte // the payload column's text: canonical JSON as written
	payloadSHA256    string // the column, as written by the producer of the row
	tenantID         string // empty when NULL or when the table has no such column
}

// decode reads an outbox row from an insert tuple (text format). Errors wrap
// ErrInvalidRow. It allocates twice: once for the text fields, once for the
// payload.
func (rel *relation) decode(t *pglogrepl.TupleData) (outboxRow, error) {
	var row outboxRow
	if t == nil || len(t.Columns) != rel.ncols {
		return row, fmt.Errorf("%w: insert into %s has a tuple that does not match its relation", ErrInvalidRow, rel.name)
	}
	var text [numCols][]byte
	for i, pos := range rel.index {
		if i == colTenantID && (pos < 0 || t.Columns[pos].DataType == pglogrepl.TupleDataTypeNull) {
			continue
		}
		c := t.Columns[pos]
		if c.DataType != pglogrepl.TupleDataTypeText {
			return row, fmt.Errorf("%w: column %s of %s: tuple data type %q, want text", ErrInvalidRow, outboxColumns[i], rel.name, c.DataType)
		}
		text[i] = c.Data
	}
	var sb strings.Builder
	sb.Grow(len(text[colOutboxID]) + len(text[colAggregateID]) + len(text[colEventType]) + len(text[colPayloadSHA256]) + len(text[colTenantID]))
	sb.Write(text[colOutboxID])
	sb.Write(text[colAggregateID])
	sb.Write(text[colEventType])
	sb.Write(text[colPayloadSHA256])
	sb.Write(text[colTenantID])
	all := sb.String()
	a := len(text[colOutboxID])
	b := a + len(text[colAggregateID])
	c := b + len(text[colEventType])
	d := c + len(text[colPayloadSHA256])
	row.outboxID, row.aggregateID, row.eventType, row.payloadSHA256, row.tenantID = all[:a], all[a:b], all[b:c], all[c:d], all[d:]
	row.payload = append([]byte(nil), text[colPayload]...)
	v, err := strconv.ParseInt(string(text[colAggregateVersion]), 10, 64)
	if err != nil {
		return row, fmt.Errorf("%w: outbox row %s: aggregate_version %q: %v", ErrInvalidRow, row.outboxID, text[colAggregateVersion], err)
	}
	row.aggregateVersion = v
	return row, nil
}

// record builds the Kafka record of row (the taskevent contract): key =
// aggregate_id (the task id), value = the payload bytes as stored, headers
// as taskevent.Headers with the payload_sha256 column. It reports whether
// the column is the SHA-256 of the payload bytes.
//
// Every writer stores the canonical JSON it encoded and hashed (package
// outbox, taskevent.Encode), so the stored bytes are the value: the relay
// hashes them and never parses them. A row whose column is not the hash of
// its bytes is relayed as it is, column as header (consumers detect the
// mismatch and dead-letter the record), and the caller counts it; a payload
// that is JSON but not I-JSON is relayed too and refused by the consumers'
// strict decoding. Either way the stream goes on.
//
// The value shares row.payload. The record takes two allocations: the
// record with its headers, and one buffer for the key and the header
// values.
func (row outboxRow) record(topic string) (rec *kgo.Record, hashMatches bool) {
	hs := taskevent.Headers(row.outboxID, row.eventType, row.aggregateVersion, row.payloadSHA256, row.tenantID)
	r := new(recordWithHeaders)
	buf := make([]byte, 0, len(row.aggregateID)+valuesLen(&hs))
	buf = append(buf, row.aggregateID...)
	key := buf[:len(buf):len(buf)]
	appendHeaders(&r.headers, buf, &hs)
	r.rec = kgo.Record{
		Topic:   topic,
		Key:     key,
		Value:   row.payload,
		Headers: r.headers[:],
	}
	return &r.rec, sha256HexEqual(row.payload, row.payloadSHA256)
}

// sha256HexEqual reports whether sum is the lowercase hex SHA-256 of b,
// without allocating.
func sha256HexEqual(b []byte, sum string) bool {
	if len(sum) != 2*sha256.Size {
		return false
	}
	h := sha256.Sum256(b)
	var x [2 * sha256.Size]byte
	hex.Encode(x[:], h[:])
	return string(x[:]) == sum
}

// RecordOf builds the Kafka record of a stored outbox row exactly as the
// relay does (record): the same key, value and headers, so that a
// republication carries the original message id (seed 4.1) and consumers'
// inboxes treat it as the same message.
func RecordOf(s outbox.Stored, topic string) *kgo.Record {
	rec, _ := outboxRow{outboxID: s.ID, aggregateID: s.TaskID, aggregateVersion: s.Version, eventType: s.Type,
		payload: s.Payload, payloadSHA256: s.PayloadSHA256, tenantID: s.TenantID}.record(topic)
	return rec
}
