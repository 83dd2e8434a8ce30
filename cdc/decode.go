package cdc

import (
	"fmt"
	"strconv"

	"github.com/jackc/pglogrepl"
	"github.com/twmb/franz-go/pkg/kgo"

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
	numCols
)

var outboxColumns = [numCols]string{
	colOutboxID:         "outbox_id",
	colAggregateID:      "aggregate_id",
	colAggregateVersion: "aggregate_version",
	colEventType:        "event_type",
	colPayload:          "payload",
	colPayloadSHA256:    "payload_sha256",
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

// newRelation maps the columns of m. It fails when m is public.outbox_event
// but lacks a column the relay needs.
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
	for i, pos := range rel.index {
		if pos < 0 {
			return nil, fmt.Errorf("relation %s (oid %d) has no column %s", rel.name, m.RelationID, outboxColumns[i])
		}
	}
	return rel, nil
}

// outboxRow is one inserted outbox_event row. Its fields are copies: the
// tuple's bytes belong to the connection's read buffer.
type outboxRow struct {
	outboxID         string
	aggregateID      string
	aggregateVersion int64
	eventType        string
	payload          []byte // jsonb text output
	payloadSHA256    string // the column, as written by the producer of the row
}

// decode reads an outbox row from an insert tuple (text format). Errors wrap
// ErrInvalidRow.
func (rel *relation) decode(t *pglogrepl.TupleData) (outboxRow, error) {
	var row outboxRow
	if t == nil || len(t.Columns) != rel.ncols {
		return row, fmt.Errorf("%w: insert into %s has a tuple that does not match its relation", ErrInvalidRow, rel.name)
	}
	var text [numCols][]byte
	for i, pos := range rel.index {
		c := t.Columns[pos]
		if c.DataType != pglogrepl.TupleDataTypeText {
			return row, fmt.Errorf("%w: column %s of %s: tuple data type %q, want text", ErrInvalidRow, outboxColumns[i], rel.name, c.DataType)
		}
		text[i] = c.Data
	}
	row.outboxID = string(text[colOutboxID])
	row.aggregateID = string(text[colAggregateID])
	row.eventType = string(text[colEventType])
	row.payloadSHA256 = string(text[colPayloadSHA256])
	row.payload = append([]byte(nil), text[colPayload]...)
	v, err := strconv.ParseInt(string(text[colAggregateVersion]), 10, 64)
	if err != nil {
		return row, fmt.Errorf("%w: outbox row %s: aggregate_version %q: %v", ErrInvalidRow, row.outboxID, text[colAggregateVersion], err)
	}
	row.aggregateVersion = v
	return row, nil
}

// record builds the Kafka record of row (the taskevent contract): key =
// aggregate_id (the task id), value = RFC 8785 form of the payload, headers
// from taskevent.Headers with the payload_sha256 column. It also returns the
// SHA-256 of the value, which must equal the column. A payload that cannot be
// canonicalized (RFC 8785 / I-JSON) is an error wrapping ErrInvalidRow.
func (row outboxRow) record(topic string) (*kgo.Record, string, error) {
	value, sum, err := taskevent.Canonical(row.payload)
	if err != nil {
		return nil, "", fmt.Errorf("%w: outbox row %s: %v", ErrInvalidRow, row.outboxID, err)
	}
	hs := taskevent.Headers(row.outboxID, row.eventType, row.aggregateVersion, row.payloadSHA256)
	headers := make([]kgo.RecordHeader, len(hs))
	for i, h := range hs {
		headers[i] = kgo.RecordHeader{Key: h[0], Value: []byte(h[1])}
	}
	return &kgo.Record{
		Topic:   topic,
		Key:     []byte(row.aggregateID),
		Value:   value,
		Headers: headers,
	}, sum, nil
}
