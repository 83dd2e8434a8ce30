// Package submit is the client side of `converge submit`: it sends JSON files
// to the API with a stable Idempotency-Key derived from each file's content,
// waits until each task is terminal, and reports one line per document.
//
// Because the key is derived from the content, submitting the same files
// again creates no new tasks: the API replays the first response (seed
// section 3), and the reported task ids are the same.
package submit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/converge-run/converge/internal/taskevent"
)

// Client talks to a converge API.
type Client struct {
	// BaseURL like http://127.0.0.1:8080. Required.
	BaseURL string
	// Token is the API token sent as "Authorization: Bearer <Token>"
	// (internal/tenant); empty sends none.
	Token string
	// HTTP defaults to a client with a 60 s timeout.
	HTTP *http.Client
	// PollInterval between task reads while waiting. Defaults to 50 ms.
	PollInterval time.Duration
}

func (c *Client) http() *http.Client {
	if c.HTTP != nil {
		return c.HTTP
	}
	return &http.Client{Timeout: 60 * time.Second}
}

// Result is the outcome of one document.
type Result struct {
	Path       string
	Key        string
	HTTPStatus int
	Replayed   bool
	TaskID     string
	Status     string // task status, or "rejected" when the API refused it
	// ArtifactSHA256 of a completed task.
	ArtifactSHA256 string
	// ErrorCode of a rejected request (problem "code") or failed task.
	ErrorCode string
	// Latency is the task's created → terminal time measured by the server
	// (completed_at or updated_at minus created_at).
	Latency time.Duration
	Err     error
}

// KeyFor returns the idempotency key for a document's bytes:
// "doc-" + the first 48 hex digits of their SHA-256.
func KeyFor(content []byte) string {
	sum := sha256.Sum256(content)
	return "doc-" + hex.EncodeToString(sum[:24])
}

// Files expands paths: files are taken as given, directories are walked for
// *.json files. The result is sorted and without duplicates.
func Files(paths []string) ([]string, error) {
	seen := map[string]bool{}
	var out []string
	for _, p := range paths {
		st, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		// The walk below yields cleaned paths (filepath.Join), so an explicit
		// file must be cleaned too, or "./d/a.json" and the walk's "d/a.json"
		// would be submitted twice.
		p = filepath.Clean(p)
		if !st.IsDir() {
			if !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
			continue
		}
		err = filepath.WalkDir(p, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if !d.IsDir() && strings.HasSuffix(d.Name(), ".json") && !seen[path] {
				seen[path] = true
				out = append(out, path)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	sort.Strings(out)
	return out, nil
}

type problem struct {
	Code   string `json:"code"`
	Detail string `json:"detail"`
}

// Create submits one document (the file's bytes as the "document" member).
func (c *Client) Create(ctx context.Context, key string, doc []byte) (Result, error) {
	body := make([]byte, 0, len(doc)+48)
	body = append(body, `{"output_format":"jcs","document":`...)
	body = append(body, doc...)
	body = append(body, '}')
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+"/v1/tasks", bytes.NewReader(body))
	if err != nil {
		return Result{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	c.authorize(req)
	resp, err := c.http().Do(req)
	if err != nil {
		return Result{}, fmt.Errorf("POST /v1/tasks: %w", err)
	}
	defer resp.Body.Close()
	rb, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return Result{}, err
	}
	r := Result{Key: key, HTTPStatus: resp.StatusCode, Replayed: resp.Header.Get("Idempotent-Replayed") == "true"}
	if resp.StatusCode >= 300 {
		var p problem
		_ = json.Unmarshal(rb, &p)
		r.Status, r.ErrorCode = "rejected", p.Code
		if r.ErrorCode == "" {
			r.ErrorCode = fmt.Sprintf("HTTP_%d", resp.StatusCode)
		}
		return r, nil
	}
	var created struct {
		TaskID string `json:"task_id"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal(rb, &created); err != nil || created.TaskID == "" {
		return r, fmt.Errorf("unexpected create response %d: %.200s", resp.StatusCode, rb)
	}
	r.TaskID, r.Status = created.TaskID, created.Status
	return r, nil
}

func (c *Client) authorize(req *http.Request) {
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
}

// Get reads a task.
func (c *Client) Get(ctx context.Context, taskID string) (*taskevent.Task, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/v1/tasks/"+taskID, nil)
	if err != nil {
		return nil, err
	}
	c.authorize(req)
	resp, err := c.http().Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("GET task %s: %d %s", taskID, resp.StatusCode, b)
	}
	var t taskevent.Task
	if err := json.NewDecoder(resp.Body).Decode(&t); err != nil {
		return nil, err
	}
	return &t, nil
}

// Wait polls a task until it is terminal or ctx ends.
func (c *Client) Wait(ctx context.Context, taskID string) (*taskevent.Task, error) {
	iv := c.PollInterval
	if iv == 0 {
		iv = 50 * time.Millisecond
	}
	for {
		t, err := c.Get(ctx, taskID)
		if err == nil && taskevent.Terminal(t.Status) {
			return t, nil
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = fmt.Errorf("task %s still %s", taskID, t.Status)
			}
			return t, fmt.Errorf("%w: %v", ctx.Err(), err)
		case <-time.After(iv):
		}
	}
}

// Document submits one file and waits for its task (at most timeout).
func (c *Client) Document(ctx context.Context, path string, timeout time.Duration) Result {
	doc, err := os.ReadFile(path)
	if err != nil {
		return Result{Path: path, Status: "error", Err: err}
	}
	r, err := c.Create(ctx, KeyFor(doc), doc)
	r.Path = path
	if err != nil {
		r.Status, r.Err = "error", err
		return r
	}
	if r.TaskID == "" {
		return r
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t, err := c.Wait(wctx, r.TaskID)
	if err != nil {
		r.Status, r.Err = "timeout", err
		return r
	}
	r.Status = t.Status
	if t.ArtifactSHA256 != nil {
		r.ArtifactSHA256 = *t.ArtifactSHA256
	}
	if t.TerminalErrorCode != nil {
		r.ErrorCode = *t.TerminalErrorCode
	}
	end := t.UpdatedAt
	if t.CompletedAt != nil {
		end = *t.CompletedAt
	}
	r.Latency = end.Sub(t.CreatedAt)
	return r
}

// Summary counts results.
type Summary struct {
	Documents, Completed, Failed, Rejected, Errors, Replayed int
}

// OK reports whether every document completed.
func (s Summary) OK() bool { return s.Completed == s.Documents }

// Run submits every file under paths with at most concurrency requests in
// flight, writes one line per document to w (in input order) and a summary,
// and returns the summary.
func Run(ctx context.Context, w io.Writer, c *Client, paths []string, concurrency int, timeout time.Duration) (Summary, error) {
	files, err := Files(paths)
	if err != nil {
		return Summary{}, err
	}
	if len(files) == 0 {
		return Summary{}, errors.New("no JSON files found")
	}
	if concurrency < 1 {
		concurrency = 8
	}
	results := make([]Result, len(files))
	sem := make(chan struct{}, concurrency)
	var wg sync.WaitGroup
	for i, f := range files {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			results[i] = c.Document(ctx, f, timeout)
		}()
	}
	wg.Wait()
	var s Summary
	s.Documents = len(results)
	for _, r := range results {
		fmt.Fprintln(w, Line(r))
		switch r.Status {
		case taskevent.StatusCompleted:
			s.Completed++
		case "rejected":
			s.Rejected++
		case "error", "timeout":
			s.Errors++
		default:
			s.Failed++
		}
		if r.Replayed {
			s.Replayed++
		}
	}
	fmt.Fprintf(w, "%d documents: %d completed, %d failed, %d rejected, %d errors; already submitted: %d (replayed, no new task)\n",
		s.Documents, s.Completed, s.Failed, s.Rejected, s.Errors, s.Replayed)
	return s, nil
}

// Line formats one result: status, task id, artifact sha256 or error code,
// latency, path.
func Line(r Result) string {
	id := r.TaskID
	if id == "" {
		id = "-"
	}
	what := r.ArtifactSHA256
	if what == "" {
		what = r.ErrorCode
	}
	if what == "" && r.Err != nil {
		what = r.Err.Error()
	}
	lat := "-"
	if r.Latency > 0 {
		lat = r.Latency.Round(time.Millisecond).String()
	}
	return fmt.Sprintf("%-9s %-36s %-64s %8s  %s", r.Status, id, what, lat, r.Path)
}
