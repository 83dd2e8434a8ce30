package artifact

import "os"

// NamedTemporaryFiles makes s write its temporary files with names in tmp/
// (the fallback where O_TMPFILE is not supported), so that tests cover it
// on machines where the unnamed files are.
func NamedTemporaryFiles(s *Store) { s.unnamed = false }

// UnnamedTemporaryFiles reports whether s writes unnamed temporary files.
func UnnamedTemporaryFiles(s *Store) bool { return s.unnamed }

// Erase is Delete's step 1 alone, for objects/<token>.obj: what a crash
// between the erasure and the removal of the names leaves.
func Erase(s *Store, token string) error {
	e, err := s.erase(s.path("objects", token, objExt), token)
	if e.f != nil {
		e.f.Close()
	}
	return err
}

// BeforeWrite sets the hook putMany runs after it found every item absent
// and before it writes any (a concurrent Put committing there wins).
func BeforeWrite(s *Store, f func()) { s.beforeWrite = f }

// EraseOpened is Delete's step 1 for objects/<token>.obj on f, the name
// opened earlier: what a Delete that opened the name before a concurrent
// Delete removed it does next.
func EraseOpened(s *Store, f *os.File, token string) error {
	e, err := s.eraseOpen(f, s.path("objects", token, objExt), token)
	if e.f != nil && e.f != f {
		e.f.Close()
	}
	return err
}
