package ident

import (
	"regexp"
	"strings"
	"testing"
)

// The regular expressions the callers were written with: the oracle.
var oracles = []struct {
	re         *regexp.Regexp
	min, max   int
	alnumFirst bool
}{
	{regexp.MustCompile(`^[A-Za-z0-9_.:-]{6,255}$`), 6, 255, false},           // api: Idempotency-Key
	{regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$`), 1, 128, true}, // api: task id in a path
	{regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,179}$`), 1, 180, true}, // artifact: token
}

func check(t *testing.T, s string) {
	t.Helper()
	for _, o := range oracles {
		if got, want := Valid(s, o.min, o.max, o.alnumFirst), o.re.MatchString(s); got != want {
			t.Fatalf("Valid(%q, %d, %d, %v) = %v, %s says %v", s, o.min, o.max, o.alnumFirst, got, o.re, want)
		}
	}
}

func TestValidAgreesWithTheExpressions(t *testing.T) {
	for _, s := range []string{
		"", "a", "abcde", "abcdef", "-abcdef", ".x", "_x", ":x", "0", "A",
		"0193a4f2-7c1e-7d3a-9b2e-5f6a7b8c9d0e.attempt-1", "key:with.dots_and-dash",
		"abc def", "abcdé", "abc\x00def", "abc/def", "abcdef\n", "\xffabcdef", "abc+def",
		strings.Repeat("a", 127), strings.Repeat("a", 128), strings.Repeat("a", 129),
		strings.Repeat("a", 179), strings.Repeat("a", 180), strings.Repeat("a", 181),
		strings.Repeat("a", 255), strings.Repeat("a", 256), "-" + strings.Repeat("a", 100),
	} {
		check(t, s)
	}
	for c := 0; c < 256; c++ {
		check(t, string([]byte{byte(c)}))
		check(t, "abcdef"+string([]byte{byte(c)}))
		check(t, string([]byte{byte(c)})+"abcdef")
	}
}

func FuzzValid(f *testing.F) {
	f.Add("0193a4f2-7c1e-7d3a-9b2e-5f6a7b8c9d0e.attempt-1")
	f.Add("-abcdef")
	f.Add("abc def")
	f.Fuzz(func(t *testing.T, s string) { check(t, s) })
}

func BenchmarkValid(b *testing.B) {
	s := "0193a4f2-7c1e-7d3a-9b2e-5f6a7b8c9d0e.attempt-1"
	b.Run("table", func(b *testing.B) {
		for b.Loop() {
			if !Valid(s, 1, 180, true) {
				b.Fatal(s)
			}
		}
	})
	b.Run("regexp", func(b *testing.B) {
		re := oracles[2].re
		for b.Loop() {
			if !re.MatchString(s) {
				b.Fatal(s)
			}
		}
	})
}
