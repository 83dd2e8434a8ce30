package artifact

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
