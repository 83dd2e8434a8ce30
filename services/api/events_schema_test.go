package api

import (
	"bytes"
	"context"
	"encoding/json"
	"io/fs"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/converge-run/converge/internal/taskevent"
	"github.com/converge-run/converge/schemas"
)

// eventSchemas compiles every schemas/events file, keyed by event type.
func eventSchemas(t *testing.T) (map[string]*jsonschema.Schema, map[string]map[string]any) {
	t.Helper()
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	fsys := schemas.Events()
	names, err := fs.Glob(fsys, "*.json")
	if err != nil {
		t.Fatal(err)
	}
	compiled, raw := map[string]*jsonschema.Schema{}, map[string]map[string]any{}
	for _, name := range names {
		data, err := fs.ReadFile(fsys, name)
		if err != nil {
			t.Fatal(err)
		}
		doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		id, _ := doc.(map[string]any)["$id"].(string)
		if err := c.AddResource(id, doc); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		sch, err := c.Compile(id)
		if err != nil {
			t.Fatalf("compile %s: %v", name, err)
		}
		typ, _, _ := strings.Cut(name, ".")
		compiled[typ], raw[typ] = sch, doc.(map[string]any)
	}
	for _, typ := range []string{taskevent.TypeTaskCreated, taskevent.TypeTaskCompleted, taskevent.TypeTaskFailed, taskevent.TypeTaskCancelled} {
		if compiled[typ] == nil {
			t.Fatalf("no schema for %s (files %v)", typ, names)
		}
	}
	return compiled, raw
}

func validate(t *testing.T, sch *jsonschema.Schema, value []byte) error {
	t.Helper()
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(value))
	if err != nil {
		t.Fatal(err)
	}
	return sch.Validate(inst)
}

// declared checks that every member of the encoded event (and its task) is
// declared by the schema, so a new member cannot ship undocumented.
func declared(t *testing.T, schema map[string]any, value []byte) {
	t.Helper()
	var ev map[string]any
	if err := json.Unmarshal(value, &ev); err != nil {
		t.Fatal(err)
	}
	props := schema["properties"].(map[string]any)
	taskProps := schema["$defs"].(map[string]any)["task"].(map[string]any)["properties"].(map[string]any)
	for k := range ev {
		if _, ok := props[k]; !ok {
			t.Errorf("%s: member %q not in the schema", schema["title"], k)
		}
	}
	for k := range ev["task"].(map[string]any) {
		if _, ok := taskProps[k]; !ok {
			t.Errorf("%s: task member %q not in the schema", schema["title"], k)
		}
	}
}

func TestEventSchemas(t *testing.T) {
	t.Parallel()
	b := setup(t)
	compiled, raw := eventSchemas(t)

	// The TaskCreated event the API really writes.
	id := b.post(t, "schema-key-1", wrap(`{"a":[1,2,3]}`)).json(t)["task_id"].(string)
	var payload []byte
	if err := b.db.Pool.QueryRow(context.Background(), `SELECT payload::text FROM outbox_event WHERE aggregate_id=$1`, id).Scan(&payload); err != nil {
		t.Fatal(err)
	}
	created, _, err := taskevent.Canonical(payload)
	if err != nil {
		t.Fatal(err)
	}

	// Completed and failed events as the worker encodes them.
	ev, err := taskevent.Decode(created)
	if err != nil {
		t.Fatal(err)
	}
	later := ev.Task.CreatedAt.Add(time.Second)
	sum, size := strings.Repeat("ab", 32), int64(13)
	done := ev.Task
	done.Status, done.Version, done.Attempt, done.UpdatedAt = taskevent.StatusCompleted, 2, 1, later
	done.ArtifactSHA256, done.ArtifactSize, done.CompletedAt = &sum, &size, &later
	failed := ev.Task
	code := "ARTIFACT_VERIFICATION_FAILED"
	failed.Status, failed.Version, failed.Attempt, failed.UpdatedAt, failed.TerminalErrorCode = taskevent.StatusFailed, 2, 1, later, &code
	encode := func(typ string, task taskevent.Task) []byte {
		v, _, err := taskevent.Encode(&taskevent.Event{EventID: "evt-" + typ, EventType: typ, SchemaVersion: 1,
			TaskID: task.TaskID, TaskVersion: task.Version, OccurredAt: later, Task: task})
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	cancelled := ev.Task
	cancelled.Status, cancelled.Version, cancelled.UpdatedAt = taskevent.StatusCancelled, 1, later
	events := map[string][]byte{
		taskevent.TypeTaskCancelled: encode(taskevent.TypeTaskCancelled, cancelled),
		taskevent.TypeTaskCreated:   created,
		taskevent.TypeTaskCompleted: encode(taskevent.TypeTaskCompleted, done),
		taskevent.TypeTaskFailed:    encode(taskevent.TypeTaskFailed, failed),
	}
	types := make([]string, 0, len(events))
	for typ := range events {
		types = append(types, typ)
	}
	sort.Strings(types)
	for _, typ := range types {
		if err := validate(t, compiled[typ], events[typ]); err != nil {
			t.Errorf("%s event does not match its schema: %v\n%s", typ, err, events[typ])
		}
		declared(t, raw[typ], events[typ])
		for _, other := range types {
			if other != typ && validate(t, compiled[other], events[typ]) == nil {
				t.Errorf("%s event matches the %s schema", typ, other)
			}
		}
	}

	// Contract violations are caught.
	for name, bad := range map[string][]byte{
		"completed without artifact": encode(taskevent.TypeTaskCompleted, ev.Task),
		"failed without error code":  encode(taskevent.TypeTaskFailed, func() taskevent.Task { x := failed; x.TerminalErrorCode = nil; return x }()),
		"created not at version 0":   encode(taskevent.TypeTaskCreated, func() taskevent.Task { x := ev.Task; x.Version = 3; return x }()),
		"cancelled with an artifact": encode(taskevent.TypeTaskCancelled, func() taskevent.Task { x := cancelled; x.ArtifactSHA256 = &sum; return x }()),
	} {
		var probe map[string]any
		_ = json.Unmarshal(bad, &probe)
		if validate(t, compiled[probe["event_type"].(string)], bad) == nil {
			t.Errorf("%s: accepted by its schema", name)
		}
	}
}
