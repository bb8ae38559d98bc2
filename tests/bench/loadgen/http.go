package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"
)

var errGaveUp = errors.New("not sent: the run's time limit passed")

const defaultBody = `{"model":"m","messages":[{"role":"user","content":"Say hi in one word."}]}`

// HTTPResult is what the http mode reports. Latency runs from each request's scheduled send
// time, so time spent waiting for a free connection or a late sender counts (no coordinated
// omission).
type HTTPResult struct {
	Mode         string         `json:"mode"`
	Addr         string         `json:"addr"`
	Connections  int            `json:"connections"`
	Rate         float64        `json:"offered_rate"`
	Scheduled    int            `json:"scheduled"`
	Completed    int            `json:"completed"`
	Errors       int            `json:"errors"`
	FirstError   string         `json:"first_error,omitempty"`
	Statuses     map[string]int `json:"statuses"`
	Seconds      float64        `json:"seconds"`
	Achieved     float64        `json:"achieved_rate"`
	MaxSendLagMs float64        `json:"max_send_lag_ms"`
	Latency      Percentiles    `json:"latency"`
	LatenciesUs  []int64        `json:"latencies_us,omitempty"`
}

type job struct {
	index     int
	scheduled time.Time
}

type outcome struct {
	latency time.Duration
	status  int
	err     error
}

type httpConn struct {
	addr   string
	conn   net.Conn
	reader *bufio.Reader
}

func (c *httpConn) dial() error {
	conn, err := net.DialTimeout("tcp", c.addr, 5*time.Second)
	if err != nil {
		return err
	}
	if tcp, ok := conn.(*net.TCPConn); ok {
		_ = tcp.SetNoDelay(true)
	}
	c.conn = conn
	c.reader = bufio.NewReaderSize(conn, 16<<10)
	return nil
}

func (c *httpConn) close() {
	if c.conn != nil {
		_ = c.conn.Close()
		c.conn = nil
	}
}

// do sends one pre-built request and reads the whole response; a broken or closing
// connection is replaced by the next request.
func (c *httpConn) do(raw []byte, deadline time.Time) (int, error) {
	if c.conn == nil {
		if err := c.dial(); err != nil {
			return 0, err
		}
	}
	_ = c.conn.SetDeadline(deadline)
	if _, err := c.conn.Write(raw); err != nil {
		c.close()
		return 0, err
	}
	resp, err := http.ReadResponse(c.reader, nil)
	if err != nil {
		c.close()
		return 0, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if err != nil || resp.Close {
		c.close()
	}
	return resp.StatusCode, err
}

func buildRequests(addr, path, keyHeader string, keys []string, body []byte) [][]byte {
	out := make([][]byte, len(keys))
	for i, key := range keys {
		head := fmt.Sprintf("POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n", path, addr)
		if key != "" {
			head += keyHeader + ": " + key + "\r\n"
		}
		head += "content-length: " + strconv.Itoa(len(body)) + "\r\n\r\n"
		out[i] = append([]byte(head), body...)
	}
	return out
}

func runHTTP(args []string) (*HTTPResult, error) {
	fs := flag.NewFlagSet("http", flag.ContinueOnError)
	addr := fs.String("addr", "", "host:port to send requests to")
	path := fs.String("path", "/v1/chat/completions", "request path")
	rate := fs.Float64("rate", 1000, "requests per second, constant (open loop)")
	duration := fs.Duration("duration", 2*time.Second, "scheduling time: rate x duration requests")
	connections := fs.Int("connections", 64, "keep-alive connections in the pool")
	warmup := fs.Int("warmup", 100, "requests before the measurement (closed loop), not counted")
	keysFile := fs.String("keys-file", "", "affinity keys, one per line, used in turn (none: no key header)")
	keyHeader := fs.String("key-header", "x-affinity-key", "header carrying the key")
	bodyFile := fs.String("body-file", "", "request body (default: a one-message chat completion)")
	timeout := fs.Duration("request-timeout", 10*time.Second, "deadline of one request")
	raw := fs.Bool("raw", false, "include every latency (microseconds) in the output")
	parse := commonFlags(fs)
	if err := parse(args); err != nil {
		return nil, err
	}
	if *addr == "" {
		return nil, errors.New("-addr is required")
	}
	if *rate <= 0 || *connections < 1 {
		return nil, errors.New("-rate must be positive and -connections at least 1")
	}
	keys, err := readKeys(*keysFile)
	if err != nil {
		return nil, err
	}
	body := []byte(defaultBody)
	if *bodyFile != "" {
		if body, err = os.ReadFile(*bodyFile); err != nil {
			return nil, err
		}
	}
	requests := buildRequests(*addr, *path, *keyHeader, keys, body)
	count := int(*rate * duration.Seconds())
	if count < 1 {
		return nil, errors.New("rate x duration is less than one request")
	}

	conns := make([]*httpConn, *connections)
	for i := range conns {
		conns[i] = &httpConn{addr: *addr}
		if err := conns[i].dial(); err != nil {
			return nil, err
		}
	}
	defer func() {
		for _, c := range conns {
			c.close()
		}
	}()
	for i := 0; i < *warmup; i++ {
		if _, err := conns[i%len(conns)].do(requests[i%len(requests)], time.Now().Add(*timeout)); err != nil {
			return nil, fmt.Errorf("warm-up request: %w", err)
		}
	}

	// The queue holds every scheduled request, so the sender never waits for a connection.
	jobs := make(chan job, count)
	results := make(chan outcome, count)
	var wg sync.WaitGroup
	interval := time.Duration(float64(time.Second) / *rate)
	start := time.Now().Add(20 * time.Millisecond)
	// Past this, queued requests are not sent but counted as errors: the run stays bounded
	// even when the server stops answering.
	giveUp := start.Add(*duration + *timeout)
	for _, c := range conns {
		wg.Add(1)
		go func(c *httpConn) {
			defer wg.Done()
			for j := range jobs {
				deadline := time.Now().Add(*timeout)
				if deadline.After(giveUp) {
					deadline = giveUp
				}
				if !time.Now().Before(giveUp) {
					results <- outcome{err: errGaveUp}
					continue
				}
				status, err := c.do(requests[j.index%len(requests)], deadline)
				results <- outcome{latency: time.Since(j.scheduled), status: status, err: err}
			}
		}(c)
	}
	var maxLag time.Duration
	for i := 0; i < count; i++ {
		scheduled := start.Add(time.Duration(i) * interval)
		if wait := time.Until(scheduled); wait > 0 {
			time.Sleep(wait)
		}
		if lag := time.Since(scheduled); lag > maxLag {
			maxLag = lag
		}
		jobs <- job{index: i, scheduled: scheduled}
	}
	close(jobs)
	wg.Wait()
	close(results)
	finished := time.Now()

	result := &HTTPResult{
		Mode:         "http",
		Addr:         *addr,
		Connections:  *connections,
		Rate:         *rate,
		Scheduled:    count,
		Statuses:     map[string]int{},
		MaxSendLagMs: ms(float64(maxLag)),
	}
	latencies := make([]time.Duration, 0, count)
	var firstErr error
	for r := range results {
		if r.err != nil {
			result.Errors++
			if firstErr == nil {
				firstErr = r.err
			}
			continue
		}
		result.Statuses[strconv.Itoa(r.status)]++
		latencies = append(latencies, r.latency)
		if *raw {
			result.LatenciesUs = append(result.LatenciesUs, r.latency.Microseconds())
		}
	}
	if firstErr != nil {
		result.FirstError = firstErr.Error()
	}
	result.Completed = len(latencies)
	elapsed := finished.Sub(start).Seconds()
	result.Seconds = round(elapsed, 3)
	result.Achieved = round(float64(result.Completed)/elapsed, 1)
	result.Latency = percentiles(latencies)
	return result, nil
}
