package main

import (
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/converge-run/converge/cmd/converge/internal/loadgen"
	"github.com/converge-run/converge/internal/dbpool"
)

// LoadgenCmd submits create requests at a fixed rate (open model) or with N
// back-to-back clients (closed model) and measures them.
type LoadgenCmd struct {
	APIURL      string        `name:"api-url" env:"CONVERGE_API_URL" default:"http://127.0.0.1:8080" help:"Base URL of the converge API."`
	Rate        float64       `help:"Fixed arrival rate in requests/s (open model: latency from each request's intended send time, so coordinated omission is accounted for). 0 selects the closed model."`
	Clients     int           `help:"Closed model: concurrent clients (default 16). Open model: most requests in flight (default 1000)."`
	Duration    time.Duration `default:"10s" help:"Length of the sending phase (0: until --count)."`
	Count       int           `help:"Number of requests (0: until --duration)."`
	Docs        string        `type:"existingdir" help:"Directory walked for *.json documents, sent round-robin (default: generated documents)."`
	DocSize     int           `default:"1024" help:"Size in bytes of a generated document."`
	Wait        bool          `default:"true" negatable:"" help:"After sending, read every created task until it is terminal, for the end-to-end latency."`
	WaitTimeout time.Duration `default:"60s" help:"Longest wait for the created tasks."`
	KeyPrefix   string        `help:"Start of every Idempotency-Key (default lg-<12 random hex digits>-, unique per run); each key is the prefix and the request's number, and must be one the API accepts (6 to 255 of A-Z a-z 0-9 _ . : -)."`
	DatabaseURL string        `env:"CONVERGE_DATABASE_URL" help:"PostgreSQL of the API: when set, the wait reads the created tasks with one query per poll instead of a GET per pending task (the GETs load the API while it is measured)."`
	Out         string        `type:"path" help:"Also write the result as JSON to this file."`
	Token       string        `env:"CONVERGE_TOKEN" help:"API token of the tenant the load is sent as (default: the dev tenant's token of converge dev's --data-dir)."`
	DataDir     string        `env:"CONVERGE_DATA_DIR" default:".converge" help:"Data directory of a converge dev whose dev token is used when --token is not set."`
}

// Run runs the load and prints the result; exits 1 when no request was
// accepted.
func (c *LoadgenCmd) Run(env *runEnv) error {
	tok, err := clientToken(c.Token, c.DataDir)
	if err != nil {
		return err
	}
	cfg := loadgen.Config{
		BaseURL: c.APIURL, Token: tok, Rate: c.Rate, Clients: c.Clients, Duration: c.Duration, Count: c.Count,
		DocsDir: c.Docs, DocSize: c.DocSize, Wait: c.Wait, WaitTimeout: c.WaitTimeout, Progress: os.Stderr, KeyPrefix: c.KeyPrefix,
	}
	if c.DatabaseURL != "" && c.Wait {
		pool, err := dbpool.New(env.ctx, c.DatabaseURL, "converge-loadgen")
		if err != nil {
			return fmt.Errorf("loadgen: --database-url: %w", err)
		}
		defer pool.Close()
		cfg.Tasks = &loadgen.DBTasks{Pool: pool}
	}
	res, err := loadgen.Run(env.ctx, cfg)
	if err != nil {
		return err
	}
	res.Print(os.Stdout)
	if c.Out != "" {
		b, err := json.MarshalIndent(res, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(c.Out, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write %s: %w", c.Out, err)
		}
	}
	if res.Accepted == 0 {
		return exitCode(1)
	}
	return nil
}
