// Package artifact is converge's artifact store: a local directory in which
// every object is addressed by the idempotency token of the effect that
// writes it (seed section 7), with durable, atomic writes.
//
// Layout under the root directory:
//
//	objects/<token>.obj  the name of one object: a link to the pack file that
//	                     holds it, or its one-object file
//	hidden/<token>.obj   the name of an object hidden by a compensation
//	                     (seed section 8)
//	tmp/put-*            named temporary files of Puts in progress (or
//	                     crashed), where unnamed ones are not supported;
//	                     tmp/put-probe-* names of Open's probe
//
// A pack file holds the objects that one Put or PutManyUnsynced wrote
// together (at most maxPackObjects): the line "CVPACK1", then one record
// per object: a line of JSON (the stored length in bytes, then the Meta:
// token, task id, attempt, size, sha256, time) ending in "\n", then the
// stored bytes. Each object's name is a hard link to its pack, so a pack of
// n objects takes one inode and one fsync instead of n of each, and one
// write call for its objects of at most 64 KiB (the kernel's inode
// allocation was the largest cost of a Put on ext4; BENCHMARKS.md). Delete
// erases an object's record in its pack before it removes the names; the
// pack's space is freed when the last name linking it is removed. Copies of
// the store must keep hard links (cp -a, rsync -H), or each name becomes a
// copy of its whole pack. One-object files (the Meta's JSON line, then the
// bytes), which earlier releases wrote and read, are still read, and still
// written while the database serves such a release (WriteOneObjectFiles).
//
// Put writes the pack to one temporary file, fsyncs it, hard-links it to
// objects/<token>.obj for each of its objects and fsyncs the objects
// directory (PutManyUnsynced: the same without the directory's fsync). On
// Linux the temporary file has no
// name (O_TMPFILE, where the filesystem supports it: Open probes tmp/, and
// a crash inside that probe can leave a tmp/put-probe-* name, removed by
// the next Open), so a crashed Put leaves nothing behind; elsewhere it is a
// tmp/put-* file, removed after the links (or by RemoveLeftovers after a
// crash). An object's link
// is its commit point: it fails when the name exists, so nothing is ever
// overwritten, an object is either absent or complete, and of concurrent
// Puts of one token exactly one commits; the others return what the winner's
// Meta decides (their record stays in their pack, unnamed, until the pack
// is freed). Put with a token that is already committed with the same
// content returns the existing Meta and writes nothing (the store honours
// the idempotency token); with different content it returns
// ErrTokenConflict. The Meta records the SHA-256 and size the writer
// intended, so read-back verification (Observe) detects stored bytes that
// differ from it.
//
// Hide moves an object to hidden/ (a compensation); Delete removes an
// object, readable or hidden, for good (the retention of its task), and
// Gone verifies that nothing is left under a token.
//
// Head, Open and Observe observe an object by token (the "HEAD
// artifact/effect-42" of seed section 7), which is how unknown outcomes are
// resolved.
package artifact

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/converge-run/converge/internal/fault"
	"github.com/converge-run/converge/internal/fsutil"
	"github.com/converge-run/converge/internal/ident"
)

// Meta is what the store records with each object.
type Meta struct {
	Token     string    `json:"token"`
	TaskID    string    `json:"task_id"`
	Attempt   int       `json:"attempt"`
	Size      int64     `json:"size"`
	SHA256    string    `json:"sha256"`
	CreatedAt time.Time `json:"created_at"`
}

var (
	// ErrNotFound: no committed object has this token.
	ErrNotFound = errors.New("artifact not found")
	// ErrTokenConflict: the token is committed with different content.
	ErrTokenConflict = errors.New("artifact token already holds different content")
	// ErrTimeout: the store did not confirm the write in time; the outcome is
	// unknown and must be observed with Head (never assumed).
	ErrTimeout = errors.New("artifact store timeout: outcome unknown")
	// ErrInvalidToken: the token has characters a file name cannot hold.
	ErrInvalidToken = errors.New("invalid artifact token")
)

// readBufs holds Observe's read buffers, readBuf bytes each. A read-back
// per task allocating and zeroing its own was 23 % of the bytes the converge
// process allocated in the peer bench (BENCHMARKS.md, fourteenth session).
// Nothing Observe returns refers to the buffer.
var readBufs = sync.Pool{New: func() any { b := make([]byte, readBuf); return &b }}

// validToken reports whether token is ^[A-Za-z0-9][A-Za-z0-9._:-]{0,179}$:
// a file name on every file system, with no path separator.
func validToken(token string) bool { return ident.Valid(token, 1, 180, true) }

const (
	// objExt is the file name extension of an object: header line and bytes.
	objExt = ".obj"
	// maxHeader bounds the header line of an object, newline included; an
	// object without a newline in its first maxHeader bytes is corrupt. A
	// header is a few hundred bytes (a token has at most 180).
	maxHeader = 64 << 10
	// headBuf is the first read of a header by Head.
	headBuf = 512
	// readBuf is the read buffer of Observe; its first read usually holds
	// the header and the whole artifact.
	readBuf = 32 << 10
	// oneWriteMax is the largest artifact that Put copies behind its header
	// to write the file with one call; larger ones are written with a call
	// for the header and one for the bytes, without a copy.
	oneWriteMax = 64 << 10
	// packMagic starts every pack file. It is not JSON, so a release that
	// reads only one-object files reports a pack as a corrupt header (an
	// error it retries), never as an object with other bytes.
	packMagic = "CVPACK1\n"
	// maxPackObjects bounds the objects of one pack file, and so the links
	// to one inode (ext4 allows 65,000) and the records a read of a pack
	// may skip to find its object.
	maxPackObjects = 64
)

// recordHeader is the header line of a record in a pack file: the length
// of the stored bytes that follow the line, then the Meta. Stored comes
// first and Meta.Token second, so that findRecord can skip a record and
// match a token without decoding the line.
type recordHeader struct {
	Stored int64 `json:"stored"`
	Meta
}

// Store is a directory-backed artifact store. Its zero value is not usable;
// use Open.
type Store struct {
	root   string
	faults *fault.Set
	// unnamed: Puts write unnamed temporary files (O_TMPFILE; Open probes
	// tmp/ once), which need neither a name in tmp/ nor its removal, and
	// which a crash cannot leave behind.
	unnamed bool
	// oneObject: Puts write one file per object, without a pack's magic
	// line or a record's stored length (WriteOneObjectFiles).
	oneObject bool
	// beforeWrite, when set (tests), runs in putMany after every item was
	// found absent and before any is written: where a concurrent Put of
	// the same token commits first.
	beforeWrite func()
}

// WriteOneObjectFiles makes the store's Puts write one file per object (the
// Meta's JSON line, then the bytes), the format of the releases before
// pack files, which every release reads, instead of packs. A binary does
// this while the database's schema still serves binaries that cannot read
// packs (schemas.Versions.ArtifactPacks), so that a rollback to them reads
// every artifact. Call it before the store is used.
func (s *Store) WriteOneObjectFiles() { s.oneObject = true }

// WritesPacks reports whether Puts write pack files (not after
// WriteOneObjectFiles).
func (s *Store) WritesPacks() bool { return !s.oneObject }

// Open prepares root (creating it when missing) and returns a Store. faults
// may be nil.
func Open(root string, faults *fault.Set) (*Store, error) {
	for _, d := range []string{"objects", "hidden", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, fmt.Errorf("artifact store %s: %w", root, err)
		}
	}
	return &Store{root: root, faults: faults, unnamed: unnamedSupported(filepath.Join(root, "tmp"))}, nil
}

// LeftoverAge is how old a temporary file of tmp/ must be before
// RemoveLeftovers removes it: far longer than any Put takes, so a Put in
// progress in another process is never touched.
const LeftoverAge = time.Hour

// RemoveLeftovers removes the temporary files (tmp/put-*) last modified
// more than olderThan ago: those of Puts that crashed between creating and
// removing them (kill -9, power loss; issue 13). It returns how many it
// removed; a file that vanished meanwhile is not an error. The reconciler
// calls it with LeftoverAge.
func (s *Store) RemoveLeftovers(olderThan time.Duration) (int, error) {
	return removeTempNames(filepath.Join(s.root, "tmp"), "put-", time.Now().Add(-olderThan))
}

// removeTempNames removes the files of dir whose names start with prefix
// and that were last modified at cutoff or before, and returns how many it
// removed; a file that vanished meanwhile is not an error. RemoveLeftovers
// and Open's probe (every probe name, whatever its age) share it.
func removeTempNames(dir, prefix string, cutoff time.Time) (int, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("artifact store: read %s: %w", dir, err)
	}
	n := 0
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), prefix) {
			continue
		}
		info, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return n, fmt.Errorf("artifact store: %w", err)
		}
		if info.ModTime().After(cutoff) {
			continue
		}
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return n, fmt.Errorf("artifact store: remove leftover: %w", err)
		}
		n++
	}
	return n, nil
}

// Root returns the store's directory.
func (s *Store) Root() string { return s.root }

func (s *Store) path(dir, token, ext string) string {
	return filepath.Join(s.root, dir, token+ext)
}

// Put stores data under token with the given task id and attempt, durably,
// and returns the committed Meta. See the package doc for idempotency. When
// the token is committed already, Put writes nothing but still fsyncs the
// objects directory: a PutUnsynced may have linked the object without its
// SyncObjects (a crash inside a worker run), and a Put that returns the
// object's Meta leaves its name durable.
// Fault points: artifact.corrupt-after-write (stored bytes altered, the Meta
// unchanged), artifact.put-timeout-after-commit (ErrTimeout after the commit).
func (s *Store) Put(token, taskID string, attempt int, data []byte) (Meta, error) {
	ms, errs := s.putMany([]Item{{Token: token, TaskID: taskID, Attempt: attempt, Data: data}}, true)
	return ms[0], errs[0]
}

// PutUnsynced is Put without its last step, the fsync of the objects
// directory: the object's bytes are durable when it returns, its name only
// after the next SyncObjects (a crash of the machine, not of the process,
// may lose it until then). A caller writing several objects calls
// PutUnsynced for each, or PutManyUnsynced, then SyncObjects once, and
// treats none of them as durable before that returns (the worker's runs:
// one directory fsync per run instead of one per artifact). Errors are
// Put's.
func (s *Store) PutUnsynced(token, taskID string, attempt int, data []byte) (Meta, error) {
	ms, errs := s.putMany([]Item{{Token: token, TaskID: taskID, Attempt: attempt, Data: data}}, false)
	return ms[0], errs[0]
}

// SyncObjects makes the names of every object linked so far durable: one
// fsync of the objects directory. Callers that find an object present
// (Head) which another process may have linked without syncing call it
// before they record the object as durable.
func (s *Store) SyncObjects() error {
	return fsutil.SyncDir(filepath.Join(s.root, "objects"))
}

// Item is one object of PutManyUnsynced: Put's arguments.
type Item struct {
	Token, TaskID string
	Attempt       int
	Data          []byte
}

// PutManyUnsynced is PutUnsynced of each item, in one pass that writes the
// new objects together: into one pack file per maxPackObjects objects, each
// written once, fsynced once and linked to each of its objects' names (one
// inode and one fsync per pack instead of per object; BenchmarkPutRun).
// Each object still has Put's guarantees: its bytes are durable before its
// name exists. It returns the Meta and error of each item, in items' order,
// as PutUnsynced would (fault points included, hit once per object in
// items' order).
func (s *Store) PutManyUnsynced(items []Item) ([]Meta, []error) {
	return s.putMany(items, false)
}

// newObject is an object of putMany to write: its item's index, the Meta to
// commit, the file's contents (parts, written in order), its name, and the
// outcome of writing it.
type newObject struct {
	i     int
	meta  Meta
	parts [][]byte
	dst   string
	err   error
	// at is where writePack wrote the object's record in its pack.
	at int64
}

func (s *Store) putMany(items []Item, sync bool) ([]Meta, []error) {
	metas, errs := make([]Meta, len(items)), make([]error, len(items))
	news := make([]newObject, 0, len(items))
	var found []int // items committed before: by an earlier or a concurrent Put
	// An item whose token an earlier item of this call writes is not
	// written: a pack holds one record per token, and the item is answered
	// as a concurrent Put of it would be (its dups entry: the item, and the
	// index in news of the one written).
	var firsts map[string]int
	type dup struct {
		o     newObject
		first int
	}
	var dups []dup
	for i, it := range items {
		o, done, m, err := s.prepare(it)
		if done {
			metas[i], errs[i] = m, err
			if err == nil || errors.Is(err, ErrTokenConflict) {
				found = append(found, i)
			}
			continue
		}
		o.i = i
		if k, ok := firsts[it.Token]; ok {
			dups = append(dups, dup{o, k})
			continue
		}
		if len(items) > 1 {
			if firsts == nil {
				firsts = make(map[string]int, len(items))
			}
			firsts[it.Token] = len(news)
		}
		news = append(news, o)
	}
	if s.beforeWrite != nil {
		s.beforeWrite()
	}
	s.writeNew(news)
	linked := make([]newObject, 0, len(news))
	committed := func(o newObject) {
		// Another Put committed the token: its Meta decides.
		old, herr := s.Head(o.meta.Token)
		if herr != nil {
			errs[o.i] = herr
			return
		}
		metas[o.i], errs[o.i] = decide(old, o.meta)
		found = append(found, o.i)
	}
	for _, o := range news {
		switch {
		case errors.Is(o.err, os.ErrExist):
			committed(o) // a concurrent Put committed first
		case o.err != nil:
			errs[o.i] = o.err
		default:
			linked = append(linked, o)
		}
	}
	for _, d := range dups {
		if w := news[d.first].err; w == nil || errors.Is(w, os.ErrExist) {
			committed(d.o)
		} else {
			errs[d.o.i] = w
		}
	}
	// Put syncs found objects' names too: one may have been linked by a
	// PutUnsynced whose SyncObjects never ran (a crash inside a worker run).
	if sync && len(linked)+len(found) > 0 {
		if err := s.SyncObjects(); err != nil {
			for _, o := range linked {
				errs[o.i] = err
			}
			for _, i := range found {
				errs[i] = err
			}
			return metas, errs
		}
	}
	for _, o := range linked {
		if s.faults.Hit(fault.ArtifactPutTimeoutAfterCommit) != fault.ActionNone {
			errs[o.i] = ErrTimeout
			continue
		}
		metas[o.i] = o.meta
	}
	return metas, errs
}

// prepare is the part of a Put before any write: the token checked, an
// object already committed under it decided (done, with the Meta and error
// to return), else the object to write.
func (s *Store) prepare(it Item) (o newObject, done bool, m Meta, err error) {
	if !validToken(it.Token) {
		return o, true, Meta{}, fmt.Errorf("%w: %q", ErrInvalidToken, it.Token)
	}
	sum := sha256.Sum256(it.Data)
	m = Meta{Token: it.Token, TaskID: it.TaskID, Attempt: it.Attempt, Size: int64(len(it.Data)), SHA256: hex.EncodeToString(sum[:]), CreatedAt: time.Now().UTC()}
	if old, err := s.Head(it.Token); err == nil {
		m, err := decide(old, m)
		return o, true, m, err
	} else if !errors.Is(err, ErrNotFound) {
		return o, true, Meta{}, err
	}
	var tail []byte
	if s.faults.Hit(fault.ArtifactCorruptAfterWrite) == fault.ActionCorrupt {
		tail = []byte("corrupted") // after the data, not in the header: Meta keeps the intended sha256
	}
	// The header is one line: encoding/json escapes control characters in
	// strings, so a Meta never renders a raw newline.
	var hdr []byte
	if s.oneObject {
		hdr, err = json.Marshal(m)
	} else {
		hdr, err = json.Marshal(recordHeader{Stored: int64(len(it.Data) + len(tail)), Meta: m})
	}
	if err != nil {
		return o, true, Meta{}, err
	}
	if len(hdr) >= maxHeader {
		return o, true, Meta{}, fmt.Errorf("artifact put %s: header of %d bytes, at most %d can be read back", it.Token, len(hdr)+1, maxHeader)
	}
	var parts [][]byte
	if len(it.Data) <= oneWriteMax {
		parts = [][]byte{slices.Concat(hdr, []byte{'\n'}, it.Data, tail)}
	} else {
		parts = [][]byte{append(hdr, '\n'), it.Data, tail}
	}
	return newObject{meta: m, parts: parts, dst: s.path("objects", it.Token, objExt)}, false, Meta{}, nil
}

// decide is Put's answer when old is already committed under the token of
// m: old itself when it holds the same content, else ErrTokenConflict.
func decide(old, m Meta) (Meta, error) {
	if old.SHA256 == m.SHA256 && old.TaskID == m.TaskID && old.Attempt == m.Attempt {
		return old, nil
	}
	return old, fmt.Errorf("%w: %s", ErrTokenConflict, m.Token)
}

// writeNew writes the objects of news into pack files of at most
// maxPackObjects objects each, in news' order: each pack is written to one
// temporary file, fsynced once, and hard-linked to each of its objects'
// names, setting each object's err (wrapping os.ErrExist when its name
// exists: it is never replaced; an error of the pack's file is every one
// of its objects'). All packs are written before any is fsynced, and with
// more than one their writeback is started first (startWriteback), so that
// the disk works on all of them at once. The temporary files are unnamed
// where the store supports it (s.unnamed: linked from their descriptor,
// before they are closed), else tmp/put-* files, linked by name and then
// removed.
func (s *Store) writeNew(news []newObject) {
	type pack struct {
		f    *os.File
		objs []newObject // a window of news
		err  error
	}
	packs := make([]pack, 0, (len(news)+maxPackObjects-1)/maxPackObjects)
	defer func() {
		for _, p := range packs {
			if p.f != nil {
				_ = p.f.Close()
				if !s.unnamed {
					_ = os.Remove(p.f.Name())
				}
			}
		}
	}()
	tmp := filepath.Join(s.root, "tmp")
	per := maxPackObjects
	if s.oneObject {
		per = 1
	}
	for len(news) > 0 {
		n := min(len(news), per)
		p := pack{objs: news[:n:n]}
		news = news[n:]
		if s.unnamed {
			p.f, p.err = openUnnamed(tmp)
		} else {
			p.f, p.err = os.CreateTemp(tmp, "put-*")
		}
		if p.err == nil {
			p.err = writePack(p.f, p.objs, !s.oneObject)
		} else {
			p.f = nil
		}
		packs = append(packs, p)
	}
	if len(packs) > 1 {
		for _, p := range packs {
			if p.err == nil {
				startWriteback(p.f)
			}
		}
	}
	for k := range packs {
		p := &packs[k]
		if p.err == nil {
			p.err = p.f.Sync()
		}
		var unlinked []newObject
		for i := range p.objs {
			o := &p.objs[i]
			switch {
			case p.err != nil:
				o.err = p.err
			case s.unnamed:
				o.err = linkUnnamed(p.f, o.dst)
			default:
				o.err = os.Link(p.f.Name(), o.dst)
			}
			if o.err != nil {
				if p.err == nil {
					unlinked = append(unlinked, *o)
				}
				o.err = fmt.Errorf("artifact write %s: %w", filepath.Base(o.dst), o.err)
			}
		}
		if !s.oneObject && len(unlinked) > 0 && len(unlinked) < len(p.objs) {
			// The pack lives on under its other objects' names: the records
			// no name reaches (another Put of the token won, or the link
			// failed) are erased, so that no Delete needs to find them.
			scrubUnlinked(p.f, unlinked)
		}
		// Linked or not, the close decides nothing: a linked object is
		// committed, its bytes fsynced before the link.
		if p.f != nil {
			_ = p.f.Close() // a named file's second Close fails, ignored
			if !s.unnamed {
				_ = os.Remove(p.f.Name())
			}
			p.f = nil
		}
	}
}

// scrubUnlinked erases the records of objs, which no name reaches, in the
// pack f (erased headers with an all-'-' token, zeroed bytes) and fsyncs
// it. It is best effort: a record it fails to erase is still unreachable
// by any name, and only its bytes stay on disk until the pack is freed.
func scrubUnlinked(f *os.File, objs []newObject) {
	for _, o := range objs {
		width := int64(bytes.IndexByte(o.parts[0], '\n'))
		var size int64
		for _, part := range o.parts {
			size += int64(len(part))
		}
		n := size - width - 1
		_, _ = overwriteRecord(f, o.at, width, n, strings.Repeat("-", len(o.meta.Token)))
	}
	_ = f.Sync()
}

// writePack writes a pack file of objs to f: the magic line (unless
// !magic: a one-object file), then each object's record (its parts), the
// small records gathered into one write. It sets each object's at.
func writePack(f *os.File, objs []newObject, magic bool) error {
	at := int64(0)
	if magic {
		at = int64(len(packMagic))
	}
	for i := range objs {
		objs[i].at = at
		for _, part := range objs[i].parts {
			at += int64(len(part))
		}
	}
	size := len(packMagic)
	for _, o := range objs {
		if len(o.parts) == 1 {
			size += len(o.parts[0])
		}
	}
	buf := make([]byte, 0, size)
	if magic {
		buf = append(buf, packMagic...)
	}
	for _, o := range objs {
		if len(o.parts) == 1 {
			buf = append(buf, o.parts[0]...)
			continue
		}
		for _, part := range slices.Concat([][]byte{buf}, o.parts) {
			if len(part) > 0 {
				if _, err := f.Write(part); err != nil {
					return err
				}
			}
		}
		buf = buf[:0]
	}
	if len(buf) > 0 {
		_, err := f.Write(buf)
		return err
	}
	return nil
}

// object is an open object name whose record was read: f is its pack
// file (or, for an object an earlier release wrote, its own file).
type object struct {
	f    *os.File
	meta Meta
	// off is where the stored bytes start in f; n is how many there are,
	// or -1 in a one-object file, whose bytes run to its end.
	off, n int64
	// hdr is where the record's header line starts in a pack file.
	hdr int64
	// read holds the first stored bytes, read with the header. In a
	// one-object file f's position is right after them.
	read []byte
}

// rest returns a reader of the stored bytes after o.read.
func (o object) rest() io.Reader {
	if o.n < 0 {
		return o.f
	}
	return io.NewSectionReader(o.f, o.off+int64(len(o.read)), o.n-int64(len(o.read)))
}

// openObject opens objects/<token>.obj and reads the record of token,
// reading into buf (another buffer is used when a pack's record lies
// beyond it). The error is os.ErrNotExist (from os.Open) when the object
// is absent. The caller closes o.f.
func (s *Store) openObject(token string, buf []byte) (object, error) {
	f, err := os.Open(s.path("objects", token, objExt))
	if err != nil {
		return object{}, err
	}
	o, err := readObject(f, token, buf)
	if err != nil {
		f.Close()
		return object{}, err
	}
	return o, nil
}

// readObject reads the record of token from f: a pack file (findRecord) or
// a one-object file of an earlier release.
func readObject(f *os.File, token string, buf []byte) (object, error) {
	k, err := f.ReadAt(buf, 0)
	if err != nil && err != io.EOF {
		return object{}, err
	}
	if bytes.HasPrefix(buf[:k], []byte(packMagic)) {
		return findRecord(f, token, buf, k)
	}
	line, rest, err := readHeader(f, buf)
	if err != nil {
		return object{}, err
	}
	var m Meta
	if err := json.Unmarshal(line, &m); err != nil {
		return object{}, fmt.Errorf("corrupt object header: %w", err)
	}
	return object{f: f, meta: m, off: int64(len(line)) + 1, n: -1, read: rest}, nil
}

// errCorruptPack wraps every error of a pack file that cannot be read.
var errCorruptPack = errors.New("corrupt pack file")

// findRecord reads the records of the pack file f from the first, skipping
// each whose token is not token, and returns token's. buf holds f's first
// k bytes; the next windows are read at the record sought (ReadAt), into a
// buffer of readBuf bytes or more, grown up to maxHeader for one header.
func findRecord(f *os.File, token string, buf []byte, k int) (object, error) {
	win, winOff := buf[:k], int64(0) // f's bytes winOff to winOff+len(win)
	for pos := int64(len(packMagic)); ; {
		line, ok := lineAt(win, pos-winOff)
		if !ok {
			if len(buf) < readBuf {
				buf = make([]byte, readBuf)
			}
			for {
				n, err := f.ReadAt(buf, pos)
				if err != nil && err != io.EOF {
					return object{}, err
				}
				win, winOff = buf[:n], pos
				if line, ok = lineAt(win, 0); ok {
					break
				}
				switch {
				case n == 0:
					return object{}, fmt.Errorf("%w: no record of %s", errCorruptPack, token)
				case n < len(buf):
					return object{}, fmt.Errorf("%w: record header at offset %d without a newline", errCorruptPack, pos)
				case len(buf) >= maxHeader:
					return object{}, fmt.Errorf("%w: no newline in the %d bytes at offset %d", errCorruptPack, maxHeader, pos)
				}
				buf = make([]byte, min(2*len(buf), maxHeader))
			}
		}
		stored, tok, ok := recordPrefix(line)
		if !ok {
			return object{}, fmt.Errorf("%w: record header at offset %d: %.40q", errCorruptPack, pos, line)
		}
		data := pos + int64(len(line)) + 1
		if string(tok) != token {
			pos = data + stored
			continue
		}
		var h recordHeader
		if err := json.Unmarshal(line, &h); err != nil {
			return object{}, fmt.Errorf("%w: record header of %s at offset %d: %w", errCorruptPack, token, pos, err)
		}
		if h.Token != token || h.Stored != stored {
			return object{}, fmt.Errorf("%w: record header of %s at offset %d: token %q and stored length %d decoded, %q and %d read before",
				errCorruptPack, token, pos, h.Token, h.Stored, tok, stored)
		}
		read := win[data-winOff:]
		return object{f: f, meta: h.Meta, off: data, n: stored, hdr: pos, read: read[:min(int64(len(read)), stored)]}, nil
	}
}

// lineAt returns the line of win that starts at rel, without its newline,
// and whether win holds all of it.
func lineAt(win []byte, rel int64) ([]byte, bool) {
	if rel < 0 || rel >= int64(len(win)) {
		return nil, false
	}
	i := bytes.IndexByte(win[rel:], '\n')
	if i < 0 {
		return nil, false
	}
	return win[rel : rel+int64(i)], true
}

// recordPrefix reads the stored length and the token from the start of a
// record's header line, `{"stored":<n>,"token":"<token>"`, as
// json.Marshal of a recordHeader writes it (a valid token needs no JSON
// escapes).
func recordPrefix(line []byte) (stored int64, token []byte, ok bool) {
	rest, ok := bytes.CutPrefix(line, []byte(`{"stored":`))
	if !ok {
		return 0, nil, false
	}
	i := 0
	for i < len(rest) && i < 18 && '0' <= rest[i] && rest[i] <= '9' {
		stored = stored*10 + int64(rest[i]-'0')
		i++
	}
	if rest, ok = bytes.CutPrefix(rest[i:], []byte(`,"token":"`)); i == 0 || !ok {
		return 0, nil, false
	}
	j := bytes.IndexByte(rest, '"')
	if j < 0 {
		return 0, nil, false
	}
	return stored, rest[:j], true
}

// readHeader reads from r into buf until the first newline and returns the
// line before it and the bytes read after it. buf grows up to maxHeader; a
// stream without a newline within maxHeader bytes is corrupt.
func readHeader(r io.Reader, buf []byte) (line, rest []byte, err error) {
	n := 0
	for {
		if n == len(buf) {
			if n >= maxHeader {
				return nil, nil, fmt.Errorf("corrupt object header: no newline in the first %d bytes", maxHeader)
			}
			grown := make([]byte, min(max(2*n, headBuf), maxHeader))
			copy(grown, buf[:n])
			buf = grown
		}
		k, rerr := r.Read(buf[n:])
		if i := bytes.IndexByte(buf[n:n+k], '\n'); i >= 0 {
			return buf[: n+i : n+i], buf[n+i+1 : n+k], nil
		}
		n += k
		if rerr == io.EOF {
			return nil, nil, fmt.Errorf("corrupt object header: no newline in %d bytes", n)
		}
		if rerr != nil {
			return nil, nil, rerr
		}
	}
}

// Head returns the committed Meta of token, or ErrNotFound.
func (s *Store) Head(token string) (Meta, error) {
	if !validToken(token) {
		return Meta{}, fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	o, err := s.openObject(token, make([]byte, headBuf))
	if errors.Is(err, os.ErrNotExist) {
		return Meta{}, ErrNotFound
	}
	if err != nil {
		return Meta{}, fmt.Errorf("artifact head %s: %w", token, err)
	}
	o.f.Close()
	return o.meta, nil
}

// Open returns the committed object's bytes as a stream and its Meta. The
// stream covers the artifact bytes only: offsets 0 to the stored size, as
// http.ServeContent expects. The caller closes the reader.
func (s *Store) Open(token string) (io.ReadSeekCloser, Meta, error) {
	if !validToken(token) {
		return nil, Meta{}, fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	o, err := s.openObject(token, make([]byte, headBuf))
	if errors.Is(err, os.ErrNotExist) {
		return nil, Meta{}, ErrNotFound
	}
	if err != nil {
		return nil, Meta{}, fmt.Errorf("artifact open %s: %w", token, err)
	}
	n := o.n
	if n < 0 {
		fi, err := o.f.Stat()
		if err != nil {
			o.f.Close()
			return nil, Meta{}, fmt.Errorf("artifact open %s: %w", token, err)
		}
		n = fi.Size() - o.off
	}
	return &dataReader{SectionReader: io.NewSectionReader(o.f, o.off, n), f: o.f}, o.meta, nil
}

// dataReader reads the stored bytes of one object: Read, ReadAt and Seek
// are relative to their start, after the record's header.
type dataReader struct {
	*io.SectionReader
	f *os.File
}

func (r *dataReader) Close() error { return r.f.Close() }

// Observation is what reading an object back shows.
type Observation struct {
	Meta   Meta
	Size   int64  // bytes actually stored
	SHA256 string // hex SHA-256 of the bytes actually stored
}

// Observe reads the object back in full and hashes what is stored, for
// read-back verification (seed section 7.1).
func (s *Store) Observe(token string) (Observation, error) {
	if !validToken(token) {
		return Observation{}, fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	bp := readBufs.Get().(*[]byte)
	defer readBufs.Put(bp)
	buf := *bp
	o, err := s.openObject(token, buf)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return Observation{}, ErrNotFound
	case err != nil:
		return Observation{}, fmt.Errorf("artifact read back %s: %w", token, err)
	}
	defer o.f.Close()
	h := sha256.New()
	h.Write(o.read)
	n := int64(len(o.read))
	// o.read may alias buf: it is hashed before buf is read into again.
	for r := o.rest(); ; {
		k, err := r.Read(buf)
		h.Write(buf[:k])
		n += int64(k)
		if err == io.EOF {
			break
		}
		if err != nil {
			return Observation{}, fmt.Errorf("artifact read back %s: %w", token, err)
		}
	}
	return Observation{Meta: o.meta, Size: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}

// Hide moves a committed object out of the readable set (a compensation,
// seed section 8): objects/<token>.obj goes to hidden/ under the same name.
// Hiding an object that
// is already hidden or absent is not an error: the call is idempotent.
// Fault point: artifact.hide-timeout-after-commit (ErrTimeout after hiding).
func (s *Store) Hide(token string) error {
	if !validToken(token) {
		return fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	if err := s.hideFile(token + objExt); err != nil {
		return fmt.Errorf("artifact hide %s: %w", token, err)
	}
	if err := fsutil.SyncDir(filepath.Join(s.root, "hidden")); err != nil {
		return err
	}
	if err := fsutil.SyncDir(filepath.Join(s.root, "objects")); err != nil {
		return err
	}
	if s.faults.Hit(fault.ArtifactHideTimeoutAfterCommit) != fault.ActionNone {
		return ErrTimeout // hidden, but the caller does not know (seed 14)
	}
	return nil
}

// hideFile renames objects/name to hidden/name; an absent name is not an
// error.
func (s *Store) hideFile(name string) error {
	err := os.Rename(filepath.Join(s.root, "objects", name), filepath.Join(s.root, "hidden", name))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// Delete removes the object of token for good, readable or hidden. In a
// pack file, which may hold other objects' records too, it erases the
// object's record in two steps around the removal of its names, so that
// neither its bytes nor its Meta nor its token (which holds the task id)
// outlive it in a pack whose other objects are kept:
//
//  1. erase: the stored bytes are overwritten with zeros and the header
//     with one of the same length that keeps only the stored length and
//     the token (`{"stored":<n>,"token":"<token>","erased":true`, padded),
//     then the pack is fsynced;
//  2. objects/<token>.obj and hidden/<token>.obj are removed and both
//     directories fsynced, so a removal it reported survives a crash of
//     the machine;
//  3. the token in the header is overwritten with '-' (no valid token is
//     all '-', so no reader matches it; they skip the record by its
//     length), through the pack still open from step 1, and the pack is
//     fsynced.
//
// A crash in step 1 or between steps 1 and 2 leaves the name, and Delete
// again finds the record by its token and goes on (Head and Observe in
// between find a Meta with the token only, and bytes that differ from
// it). A crash between steps 2 and 3, or a failure of a directory's fsync
// in step 2 or of step 3 itself, leaves the token, without bytes or Meta,
// in the pack until the pack's last name goes (a retry finds the names
// gone): the one case in which something of a deleted object stays. A
// record no name ever reached (its Put lost the race for the token) was
// erased when it was written (scrubUnlinked). A Delete that opened a name
// a concurrent Delete then removed finds nothing left to do. A pack in which the record cannot be found (damaged) is not
// erased and its names are not removed: Delete fails, every time, so that
// a deletion it reports done never left the bytes behind. The pack's space
// is freed with its last name. The overwrites act in place: on
// copy-on-write filesystems (btrfs, ZFS) the old blocks may persist until
// reused. Deleting an absent object is not an error (the call is
// idempotent: a deletion retried after a crash finds it done). Only the
// retention of whole tasks calls it (through DeleteMany), under each
// object's own ledger entry
// (ledger.DeleteArtifacts, kind artifact.delete); Gone verifies it.
func (s *Store) Delete(token string) error {
	return s.DeleteMany([]string{token})[0]
}

// DeleteMany is Delete for each of tokens, with the steps' fsyncs shared:
// every token goes through step 1, then each pack erased is fsynced once;
// then every erased token through step 2, with each directory fsynced
// once; then step 3, with each pack fsynced once. Each token so passes
// the same steps, in the same order, behind the same barriers as in
// Delete, and a crash leaves each where Delete's crash would; what costs
// four fsyncs per object in Delete costs four per batch here, plus two
// per pack (the retention of a batch of tasks: issue 11). So Delete's one
// case of a leftover (a crash, or a failed directory fsync, between the
// removal of the names and the overwrite of the tokens leaves the token in
// its pack) leaves the tokens of the whole batch (README, task retention).
// A token whose erasure failed in hidden/ after it succeeded in objects/
// keeps its names, and its erasure in objects/ is not fsynced: the
// deletion fails and is retried whole. It returns each
// token's error (nil: deleted, or absent), in tokens' order; a token whose
// step failed goes no further, the others go on.
func (s *Store) DeleteMany(tokens []string) []error {
	errs := make([]error, len(tokens))
	if len(tokens) == 0 {
		return errs
	}
	erased := make([][]erasedRecord, len(tokens))
	defer func() {
		for _, es := range erased {
			for _, e := range es {
				e.f.Close()
			}
		}
	}()
	fail := func(i int, err error) {
		if errs[i] == nil {
			errs[i] = fmt.Errorf("artifact delete %s: %w", tokens[i], err)
		}
	}
	for i, token := range tokens {
		if !validToken(token) {
			errs[i] = fmt.Errorf("%w: %q", ErrInvalidToken, token)
			continue
		}
		for _, dir := range []string{"objects", "hidden"} {
			e, err := s.erase(s.path(dir, token, objExt), token)
			if err != nil {
				fail(i, err)
				break
			}
			if e.f != nil {
				erased[i] = append(erased[i], e)
			}
		}
	}
	syncPacks(erased, errs, fail)
	for i, token := range tokens {
		if errs[i] != nil {
			continue
		}
		for _, dir := range []string{"objects", "hidden"} {
			if err := os.Remove(s.path(dir, token, objExt)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				fail(i, err)
			}
		}
	}
	// The directories are fsynced whether a name went or not: a retry of
	// a deletion whose earlier fsync failed finds the names gone.
	for _, dir := range []string{"objects", "hidden"} {
		if err := fsutil.SyncDir(filepath.Join(s.root, dir)); err != nil {
			for i := range tokens {
				fail(i, err)
			}
		}
	}
	dashes := map[int][]byte{}
	for i, token := range tokens {
		if errs[i] != nil {
			continue
		}
		if dashes[len(token)] == nil {
			dashes[len(token)] = bytes.Repeat([]byte{'-'}, len(token))
		}
		for _, e := range erased[i] {
			if _, err := e.f.WriteAt(dashes[len(token)], e.tokenAt); err != nil {
				fail(i, fmt.Errorf("overwrite its token: %w", err))
			}
		}
	}
	syncPacks(erased, errs, func(i int, err error) { fail(i, fmt.Errorf("overwrite its token: %w", err)) })
	return errs
}

// syncPacks fsyncs each pack of erased (by token) whose token has no error
// yet, once per file (a pack holding records of several tokens is open
// once per token); a failed fsync is each of its tokens' error.
func syncPacks(erased [][]erasedRecord, errs []error, fail func(int, error)) {
	type synced struct {
		fi  os.FileInfo
		err error
	}
	var done []synced
	for i, es := range erased {
		if errs[i] != nil {
			continue
		}
		for _, e := range es {
			fi, err := e.f.Stat()
			if err == nil {
				j := slices.IndexFunc(done, func(d synced) bool { return os.SameFile(d.fi, fi) })
				if j >= 0 {
					err = done[j].err
				} else {
					err = e.f.Sync()
					done = append(done, synced{fi, err})
				}
			}
			if err != nil {
				fail(i, err)
			}
		}
	}
}

// erasedRecord is a record erase overwrote: its pack, open for writing,
// and where the token starts in its header.
type erasedRecord struct {
	f       *os.File
	tokenAt int64
}

// erase is Delete's step 1 for the name name: if name exists and is a pack
// file, it overwrites the record of token (the stored bytes with zeros, the
// header line with `{"stored":<n>,"token":"<token>","erased":true` padded
// with spaces before its "}", which readers still skip by), and returns the
// pack, still open, for its fsync (syncPacks) and step 3. A one-object file,
// left to its removal, and an absent name return no pack. A pack in which
// the record cannot be found (damaged) returns an error.
func (s *Store) erase(name, token string) (erasedRecord, error) {
	f, err := os.OpenFile(name, os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return erasedRecord{}, nil
	}
	if err != nil {
		return erasedRecord{}, err
	}
	return s.eraseOpen(f, name, token)
}

// eraseOpen is erase on f, name opened.
func (s *Store) eraseOpen(f *os.File, name, token string) (erasedRecord, error) {
	e, err := eraseIn(f, token)
	if err != nil && !sameFile(f, name) {
		// A concurrent Delete of the token removed the name (and then its
		// token) after this one opened it: nothing is left to erase here.
		err = nil
	}
	if err != nil || e.f == nil {
		f.Close()
	}
	return e, err
}

// sameFile reports whether name still names the file f is open on.
func sameFile(f *os.File, name string) bool {
	a, err := f.Stat()
	if err != nil {
		return true
	}
	b, err := os.Stat(name)
	if err != nil {
		return false
	}
	return os.SameFile(a, b)
}

func eraseIn(f *os.File, token string) (erasedRecord, error) {
	buf := make([]byte, readBuf)
	k, err := f.ReadAt(buf, 0)
	if err != nil && err != io.EOF {
		return erasedRecord{}, err
	}
	if !bytes.HasPrefix(buf[:k], []byte(packMagic)) {
		return erasedRecord{}, nil
	}
	o, err := findRecord(f, token, buf, k)
	if err != nil {
		return erasedRecord{}, fmt.Errorf("erase its record: %w", err)
	}
	tokenAt, err := overwriteRecord(f, o.hdr, o.off-1-o.hdr, o.n, token)
	if err != nil {
		return erasedRecord{}, fmt.Errorf("erase its record: %w", err)
	}
	return erasedRecord{f: f, tokenAt: tokenAt}, nil
}

// overwriteRecord overwrites the record whose header line of width bytes
// starts at hdr in the pack f: the header with
// `{"stored":<n>,"token":"<token>","erased":true` padded with spaces before
// its "}" (the same length, so readers still skip the record by it), the n
// stored bytes after it with zeros. It returns where the token starts in f.
// It does not fsync.
func overwriteRecord(f *os.File, hdr, width, n int64, token string) (tokenAt int64, err error) {
	line := fmt.Appendf(nil, `{"stored":%d,"token":"`, n)
	tokenAt = hdr + int64(len(line))
	line = fmt.Appendf(line, `%s","erased":true`, token)
	if int64(len(line)) >= width {
		return 0, fmt.Errorf("header of %d bytes at offset %d, too short for an erased one", width, hdr)
	}
	line = append(append(line, bytes.Repeat([]byte{' '}, int(width)-len(line)-1)...), '}')
	if _, err := f.WriteAt(line, hdr); err != nil {
		return 0, err
	}
	zeros := make([]byte, min(n, readBuf))
	for at := int64(0); at < n; at += int64(len(zeros)) {
		if _, err := f.WriteAt(zeros[:min(int64(len(zeros)), n-at)], hdr+width+1+at); err != nil {
			return 0, err
		}
	}
	return tokenAt, nil
}

// Gone reports whether the store holds nothing under token, neither a
// readable nor a hidden object: the read-back verification of Delete.
func (s *Store) Gone(token string) (bool, error) {
	if !validToken(token) {
		return false, fmt.Errorf("%w: %q", ErrInvalidToken, token)
	}
	for _, dir := range []string{"objects", "hidden"} {
		_, err := os.Lstat(s.path(dir, token, objExt))
		switch {
		case err == nil:
			return false, nil
		case !errors.Is(err, fs.ErrNotExist):
			return false, fmt.Errorf("artifact observe %s: %w", token, err)
		}
	}
	return true, nil
}

// Token returns the idempotency token of the artifact-writing effect of a
// task attempt: "<task_id>.attempt-<n>". The same task and attempt always give
// the same token, so a retried write lands on the same object.
func Token(taskID string, attempt int) string {
	return fmt.Sprintf("%s.attempt-%d", taskID, attempt)
}
