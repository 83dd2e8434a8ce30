// Package localredis runs a local redis-server as a child process for
// `converge dev` (make run) and tests. Nothing is persisted unless Dir is set
// and Persist is true: Redis is a derived view in converge.
package localredis

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNoBinary: redis-server is not installed.
var ErrNoBinary = errors.New("redis-server not found (install Debian's redis-server package)")

// Config describes the server to run.
type Config struct {
	// Port on 127.0.0.1. Required.
	Port int
	// Dir is the working directory (log file, dump). Required.
	Dir string
	// Persist enables RDB snapshots in Dir. Defaults to false.
	Persist bool
	// Password, when set, is required of every client (requirepass); it is
	// passed in a config file of mode 0600 in Dir, not on the command line,
	// and URL carries it. Empty: no password (tests).
	Password string
}

// Server is a running redis-server.
type Server struct {
	cfg  Config
	cmd  *exec.Cmd
	done chan struct{}
	err  error // cmd.Wait's, once done is closed
}

// Start starts redis-server and waits until it answers PING (at most 20 s).
func Start(ctx context.Context, cfg Config) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, ErrNoBinary
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	args := []string{"--bind", "127.0.0.1", "--port", strconv.Itoa(cfg.Port), "--dir", dir,
		"--logfile", filepath.Join(dir, "redis.log"), "--appendonly", "no", "--daemonize", "no",
		"--maxmemory-policy", "allkeys-lru"}
	if !cfg.Persist {
		args = append(args, "--save", "")
	}
	if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(cfg.Port)); err != nil {
		return nil, fmt.Errorf("port %d on 127.0.0.1 is already in use (choose another with CONVERGE_DEV_REDIS_PORT): %w", cfg.Port, err)
	} else {
		l.Close()
	}
	if cfg.Password != "" {
		if strings.ContainsAny(cfg.Password, " \t\r\n\"'") {
			return nil, errors.New("localredis: Password must not contain spaces or quotes")
		}
		conf := filepath.Join(dir, "redis-auth.conf")
		if err := os.WriteFile(conf, []byte("requirepass "+cfg.Password+"\n"), 0o600); err != nil {
			return nil, err
		}
		args = append([]string{conf}, args...) // the config file comes first
	}
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start redis-server: %w", err)
	}
	s := &Server{cfg: cfg, cmd: cmd, done: make(chan struct{})}
	go func() { s.err = cmd.Wait(); close(s.done) }()
	cl := redis.NewClient(&redis.Options{Addr: s.Addr(), Password: cfg.Password})
	defer cl.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if err := cl.Ping(ctx).Err(); err == nil {
			// Our own server, not another one that took the port meanwhile.
			info, _ := cl.Info(ctx, "server").Result()
			if !strings.Contains(info, "process_id:"+strconv.Itoa(cmd.Process.Pid)+"\r") {
				s.Stop()
				return nil, fmt.Errorf("port %d is served by another Redis", cfg.Port)
			}
			return s, nil
		}
		select {
		case <-s.done:
			return nil, fmt.Errorf("redis-server exited during start-up; see %s", filepath.Join(dir, "redis.log"))
		case <-ctx.Done():
			s.Stop()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, errors.New("redis-server did not answer PING within 20s")
		}
	}
}

// Addr returns host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.cfg.Port) }

// URL returns a redis:// URL for database 0.
func (s *Server) URL() string {
	if s.cfg.Password != "" {
		return "redis://:" + s.cfg.Password + "@" + s.Addr() + "/0"
	}
	return "redis://" + s.Addr() + "/0"
}

// Exited is closed when redis-server has exited, by Stop or otherwise (a
// crash, kill -9).
func (s *Server) Exited() <-chan struct{} { return s.done }

// ExitErr is redis-server's exit status (exec.Cmd.Wait's error, such as
// "signal: killed"; nil for a clean exit) once Exited is closed, nil before.
func (s *Server) ExitErr() error {
	select {
	case <-s.done:
		return s.err
	default:
		return nil
	}
}

// PID returns the redis-server process id.
func (s *Server) PID() int { return s.cmd.Process.Pid }

// Stop ends the server and waits for it.
func (s *Server) Stop() {
	if s == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}
