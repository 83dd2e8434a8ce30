package bench

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Machine describes the host, from /proc.
type Machine struct {
	Cores         int    `json:"cores"`
	CPUModel      string `json:"cpu_model"`
	MemTotalMB    int    `json:"mem_total_mb"`
	Kernel        string `json:"kernel"`
	LoadAvgBefore string `json:"loadavg_before"`
	LoadAvgAfter  string `json:"loadavg_after"`
}

func machine() Machine {
	m := Machine{Cores: runtime.NumCPU(), LoadAvgBefore: loadavg()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "MemTotal:") {
				f := strings.Fields(l)
				if len(f) >= 2 {
					kb, _ := strconv.Atoi(f[1])
					m.MemTotalMB = kb / 1024
				}
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	return m
}

// loadavg returns the first three fields of /proc/loadavg.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

// clockTick is USER_HZ, the unit of the CPU times in /proc/<pid>/stat: 100
// on every Linux architecture Go supports.
const clockTick = 100

// procCPU returns the user+system CPU time of pid from /proc/<pid>/stat,
// and its parent pid.
func procCPU(pid string) (cpu time.Duration, ppid string, ok bool) {
	cpu, _, ppid, ok = procTimes(pid)
	return cpu, ppid, ok
}

// procTimes returns the user+system CPU time of pid, that of its children
// it has waited for (cutime+cstime), and its parent pid.
func procTimes(pid string) (cpu, children time.Duration, ppid string, ok bool) {
	b, err := os.ReadFile(filepath.Join("/proc", pid, "stat"))
	if err != nil {
		return 0, 0, "", false
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, "", false
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): ppid is field 4, utime 14, stime 15,
	// cutime 16, cstime 17.
	if len(f) < 15 {
		return 0, 0, "", false
	}
	ticks := func(k int) time.Duration {
		v, _ := strconv.ParseInt(f[k], 10, 64)
		return time.Duration(v) * time.Second / clockTick
	}
	return ticks(11) + ticks(12), ticks(13) + ticks(14), f[1], true
}

// postmasterPID reads the postmaster's pid from its data directory.
func postmasterPID(dataDir string) string {
	f, err := os.Open(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	if s.Scan() {
		return strings.TrimSpace(s.Text())
	}
	return ""
}

// postgresCPU sums the CPU time of the postmaster and its children (the
// backends, WAL writer, checkpointer, WAL senders, ...): treeCPU of the
// postmaster, which waits for every backend, so the exited ones are in its
// cutime and cstime.
func postgresCPU(pm string) time.Duration { return treeCPU(pm) }

// treeCPU is the user+system CPU time of process root and of its living
// descendants, from one pass over /proc, plus that of the children root
// has waited for (cutime, cstime); 0 when root is "".
func treeCPU(root string) time.Duration {
	if root == "" {
		return 0
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	type proc struct {
		cpu, children time.Duration
		ppid          string
	}
	procs := map[string]proc{}
	for _, e := range ents {
		n := e.Name()
		if n[0] < '0' || n[0] > '9' {
			continue
		}
		if cpu, children, ppid, ok := procTimes(n); ok {
			procs[n] = proc{cpu: cpu, children: children, ppid: ppid}
		}
	}
	under := func(p string) bool {
		for range 64 { // deeper than any process tree here; a cycle ends too
			if p == root {
				return true
			}
			q, ok := procs[p]
			if !ok {
				return false
			}
			p = q.ppid
		}
		return false
	}
	var total time.Duration
	for n, p := range procs {
		switch {
		case n == root:
			total += p.cpu + p.children
		case under(p.ppid):
			total += p.cpu
		}
	}
	return total
}

// CPU is the CPU used during one measurement, in cores (CPU seconds per
// wall second) by process group.
type CPU struct {
	Converge float64 `json:"converge"`
	Postgres float64 `json:"postgres"`
	Other    float64 `json:"other,omitempty"` // pgbench or a relay subprocess
}

// cpuMeter samples the CPU time of this process and of PostgreSQL.
type cpuMeter struct {
	pm       string
	start    time.Time
	self, pg time.Duration
}

func (e *env) cpuStart() *cpuMeter {
	// Backends of a pool closed just before exit asynchronously; one that
	// exits between the reads of its own stat and of the postmaster's would
	// be counted in full at the stop sample. Let them go first.
	time.Sleep(100 * time.Millisecond)
	m := &cpuMeter{pm: postmasterPID(e.pgData), start: time.Now()}
	m.self, _, _ = procCPU("self")
	m.pg = postgresCPU(m.pm)
	return m
}

// stop returns the cores used since cpuStart; other is the CPU time of a
// child process that ran meanwhile (pgbench).
func (m *cpuMeter) stop(other time.Duration) CPU {
	wall := time.Since(m.start).Seconds()
	self, _, _ := procCPU("self")
	pg := postgresCPU(m.pm)
	if wall <= 0 {
		return CPU{}
	}
	return CPU{
		Converge: round2((self - m.self).Seconds() / wall),
		Postgres: round2((pg - m.pg).Seconds() / wall),
		Other:    round2(other.Seconds() / wall),
	}
}

func round2(f float64) float64 {
	return float64(int64(f*100+0.5)) / 100
}
