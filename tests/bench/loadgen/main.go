// Command loadgen drives the router benchmarks from outside the Python processes under test.
//
//	loadgen extproc -target 127.0.0.1:9002 ...   ext_proc Process streams, as Envoy opens them
//	loadgen http -addr 127.0.0.1:8080 ...        open-loop HTTP/1.1 load at a constant rate
//
// Each mode is bounded in count and in time and prints one JSON object on stdout.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: loadgen extproc|http [flags] (-h for the flags of a mode)")
		os.Exit(2)
	}
	var (
		result any
		err    error
	)
	switch os.Args[1] {
	case "extproc":
		result, err = runExtProc(os.Args[2:])
	case "http":
		result, err = runHTTP(os.Args[2:])
	default:
		err = fmt.Errorf("unknown mode %q (extproc or http)", os.Args[1])
	}
	stopProfile()
	if err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	if err := out.Encode(result); err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
}

// commonFlags adds the flags every mode shares and returns the parser of the mode's arguments.
func commonFlags(fs *flag.FlagSet) func(args []string) error {
	procs := fs.Int("procs", 1,
		"OS threads running Go code (GOMAXPROCS); one keeps the generator's CPU use low on a small "+
			"machine shared with the servers under test, more Go threads mostly spin")
	profile := fs.String("cpuprofile", "", "write a CPU profile of the generator to this file")
	return func(args []string) error {
		if err := fs.Parse(args); err != nil {
			return err
		}
		runtime.GOMAXPROCS(*procs)
		if *profile == "" {
			return nil
		}
		f, err := os.Create(*profile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		stopProfile = func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}
		return nil
	}
}

var stopProfile = func() {}

// readKeys returns the affinity keys of a file, one per line; no file means requests without a key.
func readKeys(path string) ([]string, error) {
	if path == "" {
		return []string{""}, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var keys []string
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		keys = append(keys, strings.TrimSpace(scanner.Text()))
	}
	if err := scanner.Err(); err != nil {
		return nil, err
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("%s holds no keys", path)
	}
	return keys, nil
}

// Percentiles are interpolated linearly between closest ranks (numpy's default), in milliseconds.
type Percentiles struct {
	P50  float64 `json:"p50_ms"`
	P90  float64 `json:"p90_ms"`
	P99  float64 `json:"p99_ms"`
	P999 float64 `json:"p999_ms"`
	Max  float64 `json:"max_ms"`
	Mean float64 `json:"mean_ms"`
}

func percentiles(samples []time.Duration) Percentiles {
	if len(samples) == 0 {
		return Percentiles{}
	}
	sorted := append([]time.Duration(nil), samples...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i] < sorted[j] })
	at := func(q float64) float64 {
		pos := q * float64(len(sorted)-1)
		lo := int(math.Floor(pos))
		hi := int(math.Ceil(pos))
		v := float64(sorted[lo]) + (pos-float64(lo))*float64(sorted[hi]-sorted[lo])
		return ms(v)
	}
	var total float64
	for _, s := range sorted {
		total += float64(s)
	}
	return Percentiles{
		P50:  at(0.50),
		P90:  at(0.90),
		P99:  at(0.99),
		P999: at(0.999),
		Max:  ms(float64(sorted[len(sorted)-1])),
		Mean: ms(total / float64(len(sorted))),
	}
}

func ms(nanoseconds float64) float64 {
	return math.Round(nanoseconds/1e3) / 1e3
}

func round(v float64, digits int) float64 {
	scale := math.Pow(10, float64(digits))
	return math.Round(v*scale) / scale
}
